"""Puts into spare slots: a copy and one request (Store), instead of Reserve, copy, Commit.

The daemon grants a fast-path connection arena slots ahead of its puts (kvstore/engine/spares.py; SPARE, which
replaces the slots the connection held: it keeps slots of one size). A put of n blocks of one size takes n of
this connection's slots for that size, copies the blocks into them, and sends STORE naming them: the daemon
binds and commits the new keys in one step and grants a new slot for each one used, so the next put of that
size makes one request again. A key already present (or being written) leaves its slot spare here. Slots are
the connection's, and a connection is one thread's (fast_channel.py), so no other thread copies into them.

Everything that does not fit answers None and the caller puts the Reserve way (with its own answers and errors):
mixed sizes, more blocks than a connection may hold, the daemon granting too few slots (then not asked again
for that size for REFUSED_S), a connection found dead before the send, an arena of another daemon incarnation.
A refusal of the Store itself (unknown namespace, another tenant's) is raised as the daemon's KVStoreError, and
the slots stay spare.

A put of more than PART_BYTES goes as several Stores, each sent as soon as its part is copied and answered in
order at the end: the daemon binds and commits one part (and evicts for its successor slots) while the client
copies the next, so only the last part's Store is not hidden behind a copy. That pays only where the daemon has
a core of its own meanwhile (more usable CPUs than copy threads, `part_bytes`): on a 2-core box its work takes a
core from the copy, and 2 MiB x 32 went at 0.86 of the copy limit in two Stores against 0.90 in one (the same
daemon, alternating, sources read from memory). Every value and slot is checked
before the first part is copied (arena_path.SlotWriter), so a put fails whole or not at all, except when the
connection breaks between parts (the daemon restarted: its arena, and what was stored in it, is gone anyway).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from kvstore.client.fast_channel import UNENCODABLE, FastChannel, FastConn, decoded_reply
from kvstore.errors import ConfigError, KVStoreError, StoreUnavailableError
from kvstore.fastpath import protocol as fp
from kvstore.fastpath import spare_bodies as sb
from kvstore.vocab import ReserveOutcome

__all__ = ["store", "spares_wanted", "parts", "part_bytes", "still_spare", "Writer", "Copy", "MAX_BLOCKS", "REFUSED_S", "PART_BYTES"]

MAX_BLOCKS = 64     # the daemon's per-connection limit (kvstore/engine/spares.py MAX_PER_OWNER)
REFUSED_S = 1.0     # after the daemon granted too few slots for a size, the Reserve way for this long
PART_BYTES = 32 << 20  # more bytes go as several Stores; a part under 24 MiB copies on one thread (copy.c)


class Writer(Protocol):
    def check(self) -> None: ...  # raise unless every block can be copied
    def copy(self, start: int, stop: int) -> None: ...  # copy blocks start..stop-1 into their slots (checked first)


# copy(incarnation, offsets): a context holding a writer of the put's blocks into those slots of that daemon's
# arena (every value and slot checked when it is made); None when this client maps another daemon's arena
Copy = Callable[[int, list[int]], AbstractContextManager[Writer | None]]


def spares_wanted(asked: bool | None) -> bool:
    """Client(spare_slots=...), else $KVSTORE_SPARE_SLOTS (unset or 1: on, 0: off). Off: every put reserves,
    and the connection holds no arena slot outside the cache (an exact replay of an eviction policy wants that)."""
    if asked is not None:
        return asked
    raw = os.environ.get("KVSTORE_SPARE_SLOTS", "").strip()
    if raw not in ("", "0", "1"):
        raise ConfigError(f"KVSTORE_SPARE_SLOTS={raw!r}: use 1 (puts through spare slots, the default) or 0")
    return raw != "0"


def part_bytes(copy_threads: int) -> int:
    """PART_BYTES where a core is left for the daemon while `copy_threads` copy (see the module docstring), else
    0: every put is one Store."""
    return PART_BYTES if _usable_cpus() > copy_threads else 0


@functools.cache
def _usable_cpus() -> int:
    """Read once: every put asks, and the affinity is a system call."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parts(n: int, size: int, limit: int | None = None) -> list[tuple[int, int]]:
    """(start, stop) of each Store of a put of n blocks of `size` bytes: as few as keep each to `limit` bytes
    (None: PART_BYTES; 0: one Store) but at least one block, their block counts as even as can be."""
    limit = PART_BYTES if limit is None else limit
    count = -(-n // max(1, limit // max(1, size))) if limit else 1
    return [(n * i // count, n * (i + 1) // count) for i in range(count)]


def _slots(channel: FastChannel, c: FastConn, size: int, n: int) -> list[int] | None:
    """n spare slots of connection c for blocks of `size` bytes. When it holds fewer, the daemon replaces all
    of them (any size) with n new ones, or with none: then the Reserve way for REFUSED_S."""
    pool = c.spares.get(size, [])
    if len(pool) < n:
        if time.monotonic() < c.spares_refused.get(size, 0.0):
            return None
        reply = channel.call_on(c, fp.SPARE, sb.encode_spare(size, n))
        if reply is None:
            return None
        pool = decoded_reply(sb.decode_spare_reply, reply)[1]
        c.spares = {size: pool}  # what it held before is freed
        if len(pool) < n:
            c.spares_refused[size] = time.monotonic() + REFUSED_S
            return None
    taken = pool[-n:]
    del pool[-n:]
    return taken


def store(channel: FastChannel, namespace: str, keys: Sequence[bytes], sizes: Sequence[int],
          copy: Copy, copy_threads: int = 1) -> tuple[list[int], int] | None:
    """(outcome per key, how many stored) of a put through spare slots; None: put the Reserve way. `copy_threads`:
    how many threads the writer copies with (whether to send the put in parts: part_bytes)."""
    n = len(keys)
    if not 0 < n <= min(MAX_BLOCKS, channel.max_batch_keys) or list(sizes).count(sizes[0]) != n:
        return None
    c = channel.conn()
    taken = _slots(channel, c, sizes[0], n)
    if taken is None:
        return None
    pool = c.spares[sizes[0]]
    bounds = parts(n, sizes[0], part_bytes(copy_threads))
    try:
        bodies = [sb.encode_store(namespace, keys[a:b], sizes[a:b], taken[a:b]) for a, b in bounds]
    except UNENCODABLE:
        pool.extend(taken)  # a key or namespace the fast format cannot carry: the Reserve way says what is wrong
        return None
    sent: list[tuple[int, int, int]] = []  # (start, stop, request id) of each Store sent
    try:
        with copy(c.incarnation, taken) as writer:
            if writer is None:
                pool.extend(taken)
                return None
            if len(bounds) > 1:
                writer.check()  # not after the first part went out
            for (a, b), body in zip(bounds, bodies):
                writer.copy(a, b)
                rid = channel.send_on(c, fp.STORE, body)
                if rid is None:  # the connection was dead: its slots went with it
                    if not sent:
                        return None
                    raise StoreUnavailableError("the fast-path connection closed during a put (the daemon restarted "
                                                "or closed it): retry the put")
                sent.append((a, b, rid))
    except BaseException:
        if channel.alive(c):
            pool.extend(taken[sent[-1][1] if sent else 0:])  # the parts not sent are still this connection's
            try:
                _answers(channel, c, sent, taken, pool, n)  # read what was sent, so the connection stays in step
            except KVStoreError:
                pass  # it broke meanwhile (dropped): the first error is the one to raise
        raise
    result, error = _answers(channel, c, sent, taken, pool, n)
    if error is not None:
        raise error
    return result


def _answers(channel: FastChannel, c: FastConn, sent: list[tuple[int, int, int]], taken: list[int],
             pool: list[int], n: int) -> tuple[tuple[list[int], int], KVStoreError | None]:
    """Read the replies to the Stores sent, in order: ((outcome per key, stored), the first refusal). A
    refused part's slots, and each key's slot that was not used, stay spare; each new slot joins the pool."""
    outcomes, stored, error = [int(ReserveOutcome.RESERVED)] * n, 0, None
    for a, b, rid in sent:
        reply = channel.reply_on(c, rid)
        if isinstance(reply, KVStoreError):
            pool.extend(taken[a:b])
            error = error or reply
            continue
        got, outs, refill = decoded_reply(sb.decode_store_reply, reply)
        stored += got
        outcomes[a:b] = outs
        pool += still_spare(taken[a:b], outs, refill)
    return (outcomes, stored), error


def still_spare(offsets: Sequence[int], outcomes: Sequence[int], refill: Sequence[int]) -> list[int]:
    """The slots a Store leaves its connection holding: each named slot whose key was not stored (present, or
    being written by someone else) and each new slot the reply grants (0: none granted for that key)."""
    return [off for off, o in zip(offsets, outcomes) if o != ReserveOutcome.RESERVED] + [off for off in refill if off]
