"""Spare slots handed from one thread to another: taken on one, copied into, and stored (STORE) on another.

Why: vLLM's connector gathers a step's KV on vLLM's thread (wait_for_save) and commits on a thread of its own
once the gather is done (a GPU copy is asynchronous). Reserving slots first put a round trip on vLLM's thread
every step; with a bank, vLLM's thread takes slots the daemon granted ahead (no request), and the commit
thread stores them, which also brings the slots that replace them (spare_puts.py says what a spare slot is).

A spare slot belongs to the connection it was granted on, so a bank has a connection of its own (dialled
apart from the threads' ones, FastChannel.dial), used by one thread at a time under `_wire`; the pool is under
`_lock`, which a request never holds, so `take` never waits for a Store in flight. One bank holds slots of one
block size (Client.slot_bank keeps one per size).

Rules that keep a slot from being copied into twice, or after it was freed:
- a slot taken is "out" until it is stored or given back; while any is out the bank never asks for a new set
  (SPARE replaces, so frees, every slot the connection held, those being copied into too): `take` answers
  None instead, and the caller reserves;
- a refused Store leaves its slots out: the caller may try again (after registering the namespace) or give
  them back;
- when the bank's connection breaks (daemon restart, a failed call), every slot it held is gone: the bank's
  epoch moves on, and slots of an older epoch are neither stored nor given back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.client.fast_channel import FastChannel, FastConn, decoded_reply
from kvstore.client.spare_puts import MAX_BLOCKS, REFUSED_S, still_spare
from kvstore.errors import KVStoreError, StoreUnavailableError
from kvstore.fastpath import protocol as fp
from kvstore.fastpath import spare_bodies as sb

__all__ = ["SlotBank", "Taken", "SlotsLostError"]


class SlotsLostError(StoreUnavailableError):
    """A Store found its spare slots gone with their connection (the daemon restarted, or handed over to a
    successor): that save is lost, a future miss. Not a sign that the store is down: the next request dials
    a new connection (the vLLM connector does not pause for it, kvstore_connector/link.py)."""


@dataclass(frozen=True)
class Taken:
    """Slots taken from a bank: their arena offsets in the daemon `incarnation`'s arena, and the bank's epoch."""

    offsets: list[int]
    incarnation: int
    epoch: int


class SlotBank:
    def __init__(self, channel: FastChannel, size: int, depth: int = MAX_BLOCKS,
                 on_incarnation: Callable[[int], None] = lambda incarnation: None) -> None:
        """Slots for blocks of `size` bytes; it asks for `depth` at a time (at most MAX_BLOCKS, the daemon's
        limit per connection), so that a take can be served while the previous one is still being stored.
        `on_incarnation(n)` is called (no lock held) when slots of daemon incarnation n are first handed out:
        the client maps that daemon's arena (Client._check_incarnation) before anyone copies into them."""
        self._channel = channel
        self._on_incarnation = on_incarnation
        self._seen = 0  # the last incarnation told to on_incarnation
        self.size = size
        self._depth = max(1, min(depth, MAX_BLOCKS))
        self._wire = threading.Lock()  # one request at a time on the bank's connection
        self._lock = threading.Lock()  # the pool and the counts
        self._conn: FastConn | None = None
        self._pool: list[int] = []
        self._out = 0                  # slots taken, not yet stored or given back
        self._epoch = 0
        self._refused_until = 0.0

    def take(self, n: int) -> Taken | None:
        """n slots to copy n blocks into, or None (the caller reserves): more than a grant holds, slots still
        out while the pool is short, the daemon refusing (then not asked again for REFUSED_S), a dead store."""
        if not 0 < n <= self._depth:
            return None
        with self._lock:
            if len(self._pool) >= n or self._out or time.monotonic() < self._refused_until:
                return self._pop(n)
        with self._wire, self._lock:  # nothing out and the pool short: a new set (locks in store's order)
            if len(self._pool) < n and not self._out:
                self._refill()
            taken = self._pop(n)
        if taken is not None and taken.incarnation != self._seen:
            self._seen = taken.incarnation
            self._on_incarnation(taken.incarnation)  # a new daemon: its arena is mapped before the copy
            if self._channel.closed:  # the client reconnected to do so, closing this bank's channel (and slots)
                return None
        return taken

    def _pop(self, n: int) -> Taken | None:
        """Under _lock: n slots from the pool, or None when it holds fewer."""
        if len(self._pool) < n or self._conn is None:
            return None
        taken = self._pool[-n:]
        del self._pool[-n:]
        self._out += n
        return Taken(taken, self._conn.incarnation, self._epoch)

    def _refill(self) -> None:
        """Under _wire and _lock, nothing out: `depth` new slots (what the connection held is freed)."""
        try:
            if self._conn is None or self._conn.dead:
                self._new_epoch()
                self._conn = self._channel.dial()
            reply = self._channel.call_on(self._conn, fp.SPARE, sb.encode_spare(self.size, self._depth))
        except KVStoreError:
            reply = None
        if reply is None:  # the connection was dead, or could not be made
            self._new_epoch()
            self._refused_until = time.monotonic() + REFUSED_S
            return
        self._pool = decoded_reply(sb.decode_spare_reply, reply)[1]
        if len(self._pool) < self._depth:  # the daemon's share of spare slots is spent: reserve for a while
            self._refused_until = time.monotonic() + REFUSED_S

    def _new_epoch(self) -> None:
        """The connection is gone, and with it every slot it held."""
        self._epoch += 1
        self._pool = []
        self._out = 0
        self._conn = None

    def store(self, namespace: str, keys: Sequence[bytes], taken: Taken) -> tuple[list[int], int]:
        """Bind and commit `keys` (copied into `taken`'s slots, in order): (outcome per key, how many stored).
        A slot whose key was present stays in the bank, as does each new slot the daemon grants. Raises the
        daemon's refusal (the slots stay out: try again, or give them back) or StoreUnavailableError (the slots
        are gone with the connection)."""
        body = sb.encode_store(namespace, list(keys), [self.size] * len(keys), taken.offsets)
        with self._wire:
            c = self._conn
            if c is None or c.dead or taken.epoch != self._epoch:
                raise SlotsLostError("the spare slots' connection closed (the daemon restarted?): their "
                                            "blocks were not stored")
            try:
                reply = self._channel.call_on(c, fp.STORE, body)
            except StoreUnavailableError as exc:
                with self._lock:
                    self._new_epoch()
                raise SlotsLostError(f"the spare slots' connection broke during the Store: {exc}") from exc
        if reply is None:
            with self._lock:
                self._new_epoch()
            raise SlotsLostError("the spare slots' connection closed before the Store: nothing stored")
        stored, outcomes, refill = decoded_reply(sb.decode_store_reply, reply)
        with self._lock:
            if taken.epoch == self._epoch:
                self._pool += still_spare(taken.offsets, outcomes, refill)
                self._out -= len(taken.offsets)
        return outcomes, stored

    def give_back(self, taken: Taken) -> None:
        """Slots taken and not stored (the copy failed, the Store was refused for good): spare again."""
        with self._lock:
            if taken.epoch == self._epoch:
                self._pool += taken.offsets
                self._out -= len(taken.offsets)

    def status(self) -> dict[str, int]:
        """For tests and inspection: slots in the pool, slots out, the epoch."""
        with self._lock:
            return {"pool": len(self._pool), "out": self._out, "epoch": self._epoch}
