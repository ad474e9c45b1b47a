"""Client.put / put_many / get / get_many / get_into / get_many_into: blocks in and out of the store.

A mixin of Client, so the data path lives in one file: batches split at max_batch_keys, each through the
arena when this client maps it, else through the Put/Get streams (stream_path.py). Through the arena:
- a put copies into this connection's spare slots and stores them with one request (spare_puts.py); when that
  does not fit, it reserves slots, copies, and commits (aborting when the copy fails);
- a get of keys all in the shared key index copies with no lease and no round trip (FastControl.lookup_here),
  checks the generations after the copy, and reads again under a lease what moved meanwhile; other gets take a
  lease, copy, and release it in the background.
What it needs of Client is declared below for the type checker (Client defines each).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvstore.client import arena_path, stream_path
from kvstore.client.arena_map import ArenaMap
from kvstore.client.batches import chunks, scatter
from kvstore.client.control import ControlPlane
from kvstore.client.rpc import Rpc
from kvstore.client.types import Lease, PutResult, Reservation
from kvstore.errors import InvalidRequestError, KVStoreError, StoreUnavailableError
from kvstore.vocab import ReserveOutcome

__all__ = ["DataCalls"]


class DataCalls:
    _rpc: Rpc
    _control: ControlPlane
    _copy_threads: int
    max_batch_keys: int

    if TYPE_CHECKING:  # Client's own methods this mixin calls: declared for the type checker only
        def _current_arena(self) -> ArenaMap | None: ...
        def _check_incarnation(self, incarnation: int) -> None: ...
        def acquire_arena(self, incarnation: int | None = None) -> ArenaMap | None: ...
        def reserve(self, namespace: str, keys: Sequence[bytes], sizes: Sequence[int]) -> Reservation: ...
        def commit(self, reservation: Reservation, checksums: Sequence[int] = ()) -> int: ...
        def abort(self, reservation: Reservation) -> int: ...
        def lookup(self, namespace: str, keys: Sequence[bytes], *, prefix: bool = False,
                   lease: bool = True) -> Lease: ...
        def release(self, leases: Sequence[Lease], *, wait: bool = False) -> None: ...

    def put(self, namespace: str, key: bytes, value: object) -> bool:
        """Store one block; False when it was already present (or being written by someone else)."""
        return self.put_many(namespace, [key], [value]).stored == 1

    def put_many(self, namespace: str, keys: Sequence[bytes], values: Sequence[object]) -> PutResult:
        if len(keys) != len(values):
            raise InvalidRequestError(f"{len(keys)} keys but {len(values)} values")
        stored = present = busy = 0
        for part in chunks(len(keys), self.max_batch_keys):
            ks, vs = list(keys[part]), list(values[part])
            if self._current_arena() is None:
                s, p = stream_path.put(self._rpc, namespace, ks, vs)
                stored, present = stored + s, present + p
                continue
            sizes = arena_path.nbytes_of(vs)
            spared = self._control.store(namespace, ks, sizes,
                                         functools.partial(self._spare_writer, values=vs, sizes=sizes),
                                         self._copy_threads)
            if spared is not None:  # copied into this connection's spare slots, stored with one request
                outcomes, s = spared
                stored += s
                present += outcomes.count(ReserveOutcome.ALREADY_PRESENT)
                busy += outcomes.count(ReserveOutcome.IN_FLIGHT)
                continue
            res = self.reserve(namespace, ks, sizes)
            written = self._write(res, vs)
            stored += self.commit(res) if written else 0
            present += res.outcomes.count(ReserveOutcome.ALREADY_PRESENT)
            busy += res.outcomes.count(ReserveOutcome.IN_FLIGHT)
        return PutResult(stored, present, busy)

    def _write(self, res: Reservation, values: Sequence[object]) -> list[int]:
        """Copy into the reserved slots; aborts (and raises) when the copy fails or the arena went away."""
        if not res.reserved_indices:
            return []
        m = self.acquire_arena(res.incarnation)
        try:
            if m is None:
                raise StoreUnavailableError("the daemon restarted during the put (its arena changed): retry the put")
            with m:
                return arena_path.write(m, res, values, self._copy_threads)
        except BaseException:
            try:
                self.abort(res)
            except KVStoreError:
                pass  # a restarted daemon does not know the reservation: nothing to abort
            raise

    @contextlib.contextmanager
    def _spare_writer(self, incarnation: int, offsets: list[int], values: Sequence[object],
                      sizes: Sequence[int] | None = None) -> Iterator[arena_path.SlotWriter | None]:
        """A writer of `values` (of `sizes` bytes, when the caller has them) into spare slots of daemon
        `incarnation`'s arena, its mapping held meanwhile; None when this client maps another one."""
        m = self.acquire_arena(incarnation)
        if m is None:
            yield None
            return
        with m:
            yield arena_path.SlotWriter(m, offsets, values, self._copy_threads, sizes)

    def _read(self, lease: Lease, buffers: Sequence[object] | None) -> list[Any]:
        """Copy a lease's hits out (into `buffers`, or as bytes); a hit of another incarnation is a miss."""
        m = self.acquire_arena(lease.incarnation)
        if m is None:
            return [None] * lease.hits
        with m:
            if buffers is None:
                return arena_path.read_bytes(m, lease)
            return arena_path.read_into(m, lease, buffers, self._copy_threads)

    # -- gets -------------------------------------------------------------------------------------------
    def get(self, namespace: str, key: bytes) -> bytes | None:
        return self.get_many(namespace, [key])[0]

    def get_many(self, namespace: str, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for part in chunks(len(keys), self.max_batch_keys):
            ks = list(keys[part])
            out.extend(stream_path.get(self._rpc, namespace, ks) if self._current_arena() is None
                       else self._get_arena(namespace, ks, None))
        return out

    def get_into(self, namespace: str, key: bytes, buffer: object) -> int | None:
        """Copy a block into `buffer` (writable, large enough); its size, or None on a miss."""
        return self.get_many_into(namespace, [key], [buffer])[0]

    def get_many_into(self, namespace: str, keys: Sequence[bytes], buffers: Sequence[object]) -> list[int | None]:
        if len(keys) != len(buffers):
            raise InvalidRequestError(f"{len(keys)} keys but {len(buffers)} buffers")
        out: list[int | None] = []
        for part in chunks(len(keys), self.max_batch_keys):
            ks, bs = list(keys[part]), list(buffers[part])
            out.extend(stream_path.get_into(self._rpc, namespace, ks, bs) if self._current_arena() is None
                       else self._get_arena(namespace, ks, bs))
        return out

    def _get_arena(self, namespace: str, keys: list[bytes], buffers: list[object] | None) -> list[Any]:
        """One batch of a get from the arena (into `buffers`, or as bytes). When the shared key index holds every
        key the copy needs no round trip and no lease (FastControl.lookup_here): each slot's generation is checked
        after the copy, and a key whose slot was reclaimed meanwhile is read again under a lease."""
        here = self._control.lookup_here(namespace, keys)
        if here is None:
            return self._get_leased(namespace, keys, buffers)
        self._check_incarnation(here.incarnation)
        got = self._read(here, buffers)
        again = [i for i, v in enumerate(got) if v is None]
        if again:
            redo = self._get_leased(namespace, [keys[i] for i in again],
                                    None if buffers is None else [buffers[i] for i in again])
            for i, v in zip(again, redo):
                got[i] = v
        return got

    def _get_leased(self, namespace: str, keys: list[bytes], buffers: list[object] | None) -> list[Any]:
        lease = self.lookup(namespace, keys)
        try:
            got = self._read(lease, None if buffers is None else [b for b, p in zip(buffers, lease.present) if p])
        finally:
            self.release([lease])
        return scatter(lease.present, got, len(keys))
