"""The client's control plane for the hot operations: one interface, two transports.

`GrpcControl` sends them as gRPC calls (any host). `FastControl` sends them over the daemon's same-node socket
(kvstore/fastpath/protocol.py, ~40 us a round trip instead of ~0.7 ms), falling back to gRPC for a request the
fast format cannot carry (a key over 255 bytes, a namespace that is not a string: the daemon's gRPC answer is
then the one a caller gets, error message included). Both return the same typed results and raise the same
KVStoreError classes, so Client never cares which one it holds.

FastControl reads the tenant's shared key index first (shared_index.py): a Lookup without lease whose every key
the index holds in RAM is answered here, with no round trip, and its effects sent one way (HITS); so is a get's
(`lookup_here`), and a prefix probe that stops short where the index is authoritative (a daemon with RAM only,
key_index.py: the index's absence of a key is then the daemon's answer); others send entry ids instead of keys
where the index has them (PROBE, LOOKUP_IDS). `settle` waits for the one-way sends. Puts go through the
connection's spare slots where they can (`store`, spare_puts.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from kvstore._proto import kvstore_pb2 as pb
from kvstore.client import spare_puts
from kvstore.client.fast_channel import UNENCODABLE, FastChannel, decoded_reply
from kvstore.client.rpc import Rpc
from kvstore.client.shared_index import SharedIndex
from kvstore.client.slot_bank import SlotBank
from kvstore.client.types import Lease, Reservation
from kvstore.errors import KVStoreError
from kvstore.fastpath import protocol as fp
from kvstore.fastpath.key_index import Entries, IndexView, MissState
from kvstore.validation import check_keys
from kvstore.vocab import Tier

__all__ = ["ControlPlane", "GrpcControl", "FastControl"]


ReserveRequest = tuple[str, Sequence[bytes], Sequence[int]]  # (namespace, keys, sizes)
_RAM, _NONE = int(Tier.RAM), int(Tier.NONE)
_COUNTING = fp.LOOKUP_PREFIX | fp.LOOKUP_SUMMARY  # a scheduler's prefix probe: no lease, counts only


class ControlPlane(Protocol):
    name: str

    def reserve(self, namespace: str, keys: Sequence[bytes], sizes: Sequence[int]) -> Reservation: ...
    def reserve_many(self, requests: Sequence[ReserveRequest]) -> list[Reservation | KVStoreError]: ...
    def commit(self, reservation_id: int, checksums: Sequence[int]) -> int: ...
    def abort(self, reservation_id: int) -> int: ...
    def lookup(self, namespace: str, keys: Sequence[bytes], prefix: bool, lease: bool,
               summary: bool = False) -> Lease: ...
    def release(self, lease_ids: list[int]) -> int: ...
    def store(self, namespace: str, keys: Sequence[bytes], sizes: Sequence[int],
              copy: spare_puts.Copy, copy_threads: int = 1) -> tuple[list[int], int] | None: ...
    def slot_bank(self, size: int, on_incarnation: Callable[[int], None]) -> SlotBank | None: ...
    def lookup_here(self, namespace: str, keys: Sequence[bytes]) -> Lease | None: ...
    def probe_many(self, namespaces: Sequence[str], keys: Sequence[bytes], prefix: bool = True) -> list[Lease]: ...
    def exists(self, namespace: str, keys: Sequence[bytes], cluster: bool = False) -> list[bool]: ...
    def settle(self) -> None: ...
    def close(self) -> None: ...


class GrpcControl:
    name = "grpc"

    def __init__(self, rpc: Rpc) -> None:
        self._rpc = rpc

    def reserve(self, namespace: str, keys: Sequence[bytes], sizes: Sequence[int]) -> Reservation:
        r = self._rpc.call("Reserve", pb.ReserveRequest(namespace=namespace, keys=keys, sizes=sizes))
        return Reservation(namespace, list(keys), r.reservation_id, list(r.outcomes), list(r.offsets), r.incarnation)

    def reserve_many(self, requests: Sequence[ReserveRequest]) -> list[Reservation | KVStoreError]:
        """Several Reserves one after another; a refused one comes back as its error in its slot."""
        out: list[Reservation | KVStoreError] = []
        for ns, keys, sizes in requests:
            try:
                out.append(self.reserve(ns, keys, sizes))
            except KVStoreError as exc:
                out.append(exc)
        return out

    def commit(self, reservation_id: int, checksums: Sequence[int]) -> int:
        return self._rpc.call("Commit", pb.CommitRequest(reservation_id=reservation_id, checksums=checksums)).committed

    def abort(self, reservation_id: int) -> int:
        return self._rpc.call("Abort", pb.AbortRequest(reservation_id=reservation_id)).aborted

    def lookup(self, namespace: str, keys: Sequence[bytes], prefix: bool, lease: bool,
               summary: bool = False) -> Lease:
        r = self._rpc.call("Lookup", pb.LookupRequest(namespace=namespace, keys=keys, prefix=prefix, lease=lease))
        return Lease(namespace, r.num_prefix, list(r.present), list(r.offsets), list(r.sizes), list(r.generations),
                     list(r.checksums), r.lease_id, r.incarnation, list(r.tiers))

    def release(self, lease_ids: list[int]) -> int:
        return self._rpc.call("Release", pb.ReleaseRequest(lease_ids=lease_ids)).released

    def lookup_here(self, namespace: str, keys: Sequence[bytes]) -> Lease | None:
        """No key index over gRPC: every get asks the daemon."""
        return None

    def store(self, namespace: str, keys: Sequence[bytes], sizes: Sequence[int],
              copy: spare_puts.Copy, copy_threads: int = 1) -> tuple[list[int], int] | None:
        """No spare slots over gRPC: every put reserves."""
        return None

    def slot_bank(self, size: int, on_incarnation: Callable[[int], None]) -> SlotBank | None:
        """No spare slots over gRPC."""
        return None

    def probe_many(self, namespaces: Sequence[str], keys: Sequence[bytes], prefix: bool = True) -> list[Lease]:
        """A Lookup without lease of `keys` in each namespace, one call after another: a prefix one counts only,
        one without `prefix` answers every key's tier."""
        return [self.lookup(ns, keys, prefix, False, summary=prefix) for ns in namespaces]

    def exists(self, namespace: str, keys: Sequence[bytes], cluster: bool = False) -> list[bool]:
        return list(self._rpc.call("Exists", pb.ExistsRequest(namespace=namespace, keys=keys, cluster=cluster)).present)

    def settle(self) -> None:
        """Every call is answered: nothing to wait for."""

    def close(self) -> None:
        return None


class FastControl:
    name = "fast"

    def __init__(self, channel: FastChannel, fallback: GrpcControl, index: SharedIndex | None = None) -> None:
        """`index`: the tenant's shared key index, which prefix probes read first (shared_index.py)."""
        self.channel = channel
        self._grpc = fallback
        self.index = index
        self.spares = True  # puts through spare slots (spare_puts.py); the Client sets it
        self._banks: dict[int, SlotBank] = {}  # block size -> its bank (slot_bank.py)
        self._banks_lock = threading.Lock()
        # (incarnation, arena offsets) -> the slots' generations in that daemon's arena, or None when it is not
        # mapped (the Client sets it): a Lookup without lease answered here needs them
        self.generations: Callable[[int, np.ndarray], np.ndarray | None] | None = None
        # namespace -> the daemon incarnation that answered a probe in it: one that exists and this client may
        # read, so an authoritative index's miss of its first key is an answer there (_misses_here)
        self._known: dict[str, int] = {}

    def reserve(self, namespace: str, keys: Sequence[bytes], sizes: Sequence[int]) -> Reservation:
        try:
            body = fp.encode_reserve(namespace, keys, sizes)
        except UNENCODABLE:
            return self._grpc.reserve(namespace, keys, sizes)
        rid, _, inc, outcomes, offsets = decoded_reply(fp.decode_reserve_reply, self.channel.call(fp.RESERVE, body))
        return Reservation(namespace, list(keys), rid, outcomes, offsets, inc)

    def reserve_many(self, requests: Sequence[ReserveRequest]) -> list[Reservation | KVStoreError]:
        """Several Reserves pipelined: one round trip for all (a hybrid model's KV cache groups, each its own
        namespace, saved in one step). A refused one comes back as its error in its slot."""
        try:
            bodies = [fp.encode_reserve(ns, keys, sizes) for ns, keys, sizes in requests]
        except UNENCODABLE:
            return self._grpc.reserve_many(requests)
        out: list[Reservation | KVStoreError] = []
        for (ns, keys, _), reply in zip(requests, self.channel.call_many([(fp.RESERVE, b, 0) for b in bodies])):
            if isinstance(reply, KVStoreError):
                out.append(reply)
                continue
            rid, _, inc, outcomes, offsets = decoded_reply(fp.decode_reserve_reply, reply)
            out.append(Reservation(ns, list(keys), rid, outcomes, offsets, inc))
        return out

    def commit(self, reservation_id: int, checksums: Sequence[int]) -> int:
        try:
            body = fp.encode_commit(reservation_id, checksums)
        except UNENCODABLE:
            return self._grpc.commit(reservation_id, checksums)
        return decoded_reply(fp.decode_count, self.channel.call(fp.COMMIT, body))

    def abort(self, reservation_id: int) -> int:
        try:
            body = fp.encode_u64(reservation_id)
        except UNENCODABLE:
            return self._grpc.abort(reservation_id)
        return decoded_reply(fp.decode_count, self.channel.call(fp.ABORT, body))

    def lookup(self, namespace: str, keys: Sequence[bytes], prefix: bool, lease: bool,
               summary: bool = False) -> Lease:
        """`summary` (without lease): counts only; the Lease comes back without hit columns. When the shared key
        index holds every key, only their entry ids go (LOOKUP_IDS); should one have gone since, the keys follow."""
        flags = ((fp.LOOKUP_PREFIX if prefix else 0) | (fp.LOOKUP_LEASE if lease else 0)
                 | (fp.LOOKUP_SUMMARY if summary and not lease else 0))
        index = self.index
        # a batch the daemon would refuse (empty, too many keys) goes to it, to be refused with its message
        view = index.view() if index is not None and 0 < len(keys) <= self.channel.max_batch_keys else None
        if index is not None and view is not None:
            found: Any = None
            try:
                ks = keys if isinstance(keys, list) else list(keys)
                if lease or summary:
                    found = view.probe(namespace, ks)
                else:  # the hit columns too: answered here when every key is in the table
                    entries = view.entries(namespace, ks)
                    if entries is not None and entries.n == len(keys):
                        mine = self._lookup_here(view, namespace, entries, flags)
                        if mine is not None:
                            return mine
                        found = (entries.n, entries.ids, entries.serials)
            except UNENCODABLE:
                found = None
            if found is not None and found[0] == len(keys) and summary and not lease:
                here = self._count_here(view, [namespace], [found], flags)
                if here is not None:
                    return here[0]
            if found is not None and found[0] == len(keys):
                reply = self.channel.call(fp.LOOKUP_IDS, fp.encode_probe(namespace, found[1], found[2], ()), flags)
                if reply:
                    r = decoded_reply(fp.decode_lookup_reply, reply)
                    index.seen(view, r.incarnation)
                    return Lease(namespace, r.num_prefix, r.present, r.offsets, r.sizes, r.generations, r.checksums,
                                 r.lease_id, r.incarnation, r.tiers)
        try:
            body = fp.encode_lookup(namespace, keys)
        except UNENCODABLE:
            return self._grpc.lookup(namespace, keys, prefix, lease)
        r = decoded_reply(fp.decode_lookup_reply, self.channel.call(fp.LOOKUP, body, flags))
        return Lease(namespace, r.num_prefix, r.present, r.offsets, r.sizes, r.generations, r.checksums, r.lease_id,
                     r.incarnation, r.tiers)

    def store(self, namespace: str, keys: Sequence[bytes], sizes: Sequence[int],
              copy: spare_puts.Copy, copy_threads: int = 1) -> tuple[list[int], int] | None:
        """A put through this connection's spare slots: a copy and one request (spare_puts.py); None: reserve."""
        return spare_puts.store(self.channel, namespace, keys, sizes, copy, copy_threads) if self.spares else None

    def slot_bank(self, size: int, on_incarnation: Callable[[int], None]) -> SlotBank | None:
        """The bank of spare slots for blocks of `size` bytes, taken on one thread and stored on another
        (slot_bank.py; one connection each); None with spare slots off."""
        if not self.spares:
            return None
        with self._banks_lock:
            bank = self._banks.get(size)
            if bank is None:
                bank = self._banks[size] = SlotBank(self.channel, size, on_incarnation=on_incarnation)
            return bank

    def lookup_here(self, namespace: str, keys: Sequence[bytes]) -> Lease | None:
        """A get's Lookup answered from the shared key index alone: without lease, with the hit columns, and only
        when every key is in the table (so in this daemon's RAM); its effects go one way (HITS). None: the get
        must ask the daemon for a lease (a key elsewhere or absent, no index, a batch the daemon would refuse).
        The HITS says the bytes were read (HITS_READ: they count as a leased Lookup's). Without a lease the slot
        may be reclaimed during the copy: the caller checks the generations after it (arena_path.validated) and
        asks again, under a lease, for what moved."""
        index = self.index
        view = index.view() if index is not None and 0 < len(keys) <= self.channel.max_batch_keys else None
        if view is None:
            return None
        try:
            entries = view.entries(namespace, keys if isinstance(keys, list) else list(keys))
        except UNENCODABLE:
            return None  # a key the fast format cannot carry: the plain path decides what to say
        if entries is None or entries.n != len(keys):
            return None
        return self._lookup_here(view, namespace, entries, fp.HITS_READ)

    def probe_many(self, namespaces: Sequence[str], keys: Sequence[bytes], prefix: bool = True) -> list[Lease]:
        """A Lookup without lease of `keys` in each namespace, pipelined: one round trip for all (the scheduler's
        probe of every TP rank's, pipeline stage's and KV cache group's namespace). A prefix one counts only
        (summary); one without `prefix` answers every key's tier (a sliding-window group's window). The first
        refused one raises."""
        view = self.index.view() if self.index is not None and prefix else None
        if view is not None and len(keys) <= self.channel.max_batch_keys:
            try:
                return self._probe_indexed(view, namespaces, keys)
            except UNENCODABLE:
                pass  # a key the fast format cannot carry (or not bytes): the plain path decides what to say
        try:
            bodies = [fp.encode_lookup(ns, keys) for ns in namespaces]
        except UNENCODABLE:
            return self._grpc.probe_many(namespaces, keys, prefix)
        flags = fp.LOOKUP_PREFIX | fp.LOOKUP_SUMMARY if prefix else 0
        out = []
        for ns, reply in zip(namespaces, self.channel.call_many([(fp.LOOKUP, b, flags) for b in bodies])):
            if isinstance(reply, KVStoreError):
                raise reply
            r = decoded_reply(fp.decode_lookup_reply, reply)
            out.append(Lease(ns, r.num_prefix, r.present, r.offsets, r.sizes, r.generations, r.checksums,
                             r.lease_id, r.incarnation, r.tiers))
        return out

    def _probe_indexed(self, view: IndexView, namespaces: Sequence[str], keys: Sequence[bytes]) -> list[Lease]:
        """Prefix probes whose leading keys come from the shared key index: each namespace's request names the
        entries found there (ids + serials) and carries only the keys after them; the daemon checks the
        entries and looks up the rest (Engine.probe), all namespaces in one round trip."""
        assert self.index is not None
        keys = keys if isinstance(keys, list) else list(keys)
        before = view.miss_state()  # before the probes: see _misses_here
        founds = [view.probe(ns, keys) for ns in namespaces]
        if keys and all(f is not None and f[0] == len(keys) for f in founds):
            here = self._count_here(view, namespaces, founds, _COUNTING)
            if here is not None:
                return here
        elif keys and before.settled and all(f is not None for f in founds):
            here = self._misses_here(view, namespaces, founds, keys, before)
            if here is not None:
                return here
        bodies = []
        for ns, found in zip(namespaces, founds):
            n, ids, serials = found if found is not None else (0, b"", b"")
            bodies.append(fp.encode_probe(ns, ids, serials, keys[n:] if n < len(keys) else ()))
        out = []
        replies = ([self.channel.call(fp.PROBE, bodies[0])] if len(bodies) == 1
                   else self.channel.call_many([(fp.PROBE, b, 0) for b in bodies]))
        for ns, reply in zip(namespaces, replies):
            if isinstance(reply, KVStoreError):
                raise reply
            num_prefix, present, tiers, incarnation = decoded_reply(fp.decode_probe_reply, reply)
            self.index.seen(view, incarnation)
            self._known[ns] = incarnation
            out.append(Lease(ns, num_prefix, present, [], [], [], [], 0, incarnation, tiers))
        return out

    def _misses_here(self, view: IndexView, namespaces: Sequence[str], founds: Sequence[Any], keys: list[bytes],
                     before: MissState) -> list[Lease] | None:
        """Prefix probes that stop short, answered from an authoritative index (key_index.py): the leading keys
        it holds, then a miss, exactly the PROBE's answer had the daemon been asked when the index was read.
        The PROBE's effects go one way (HITS naming the entries found and carrying the keys after them: the
        daemon counts and explains the miss as it would have). None: ask the daemon, when the index may have
        missed a key a Store had already answered for (a binding deferred meanwhile, `before.still`), or when a
        namespace's first key is absent and the daemon never answered this client in that namespace (it may
        not exist, or not be this tenant's: the daemon's refusal is the answer then), or when a key the index
        lacks is one the daemon would refuse (its error is the answer: check_keys, the engine's own check)."""
        incarnation = view.incarnation
        if not before.still(view.miss_state()) or any(
                f[0] == 0 and self._known.get(ns) != incarnation for ns, f in zip(namespaces, founds)):
            return None
        try:
            check_keys(keys[min(f[0] for f in founds):], self.channel.max_batch_keys)
        except KVStoreError:
            return None
        sent = self._sent_hits(view, [(ns, f[1], f[2], keys[f[0]:]) for ns, f in zip(namespaces, founds)],
                               _COUNTING)
        if sent is None:
            return None
        out = []
        for ns, (n, _, _) in zip(namespaces, founds):
            short = [False] if n < len(keys) else []
            out.append(Lease(ns, n, [True] * n + short, [], [], [], [], 0, sent, [_RAM] * n + [_NONE] * len(short)))
        return out

    def _count_here(self, view: IndexView, namespaces: Sequence[str], founds: Sequence[Any],
                    flags: int) -> list[Lease] | None:
        """Counting Lookups (no lease, no hit columns: the scheduler's probe) whose every key the shared key index
        holds in RAM, answered from the index alone: no round trip. None: ask the daemon (see _sent_hits)."""
        incarnation = self._sent_hits(view, [(ns, f[1], f[2], ()) for ns, f in zip(namespaces, founds)], flags)
        if incarnation is None:
            return None
        n = founds[0][0]
        return [Lease(ns, n, [True] * n, [], [], [], [], 0, incarnation, [_RAM] * n) for ns in namespaces]

    def _lookup_here(self, view: IndexView, namespace: str, e: Entries, flags: int) -> Lease | None:
        """A Lookup without lease whose every key the index holds, with its hit columns, answered here: sizes,
        offsets and checksums from the index, each slot's generation from the arena, read while the table's
        sequence number held still (so each is the indexed block's, not a later one's in a reused slot).
        None: ask the daemon (no arena mapped for the table's daemon, the table changed, see _sent_hits)."""
        generations = self.generations
        gens = generations(view.incarnation, e.offsets.astype(np.int64)) if generations is not None else None
        if gens is None or not view.unchanged(e.seq):
            return None
        incarnation = self._sent_hits(view, [(namespace, e.ids, e.serials, ())], flags)
        if incarnation is None:
            return None
        n = e.n
        return Lease(namespace, n, [True] * n, e.offsets.tolist(), e.sizes.tolist(), gens.tolist(),
                     e.checksums.tolist(), 0, incarnation, [_RAM] * n)

    def _sent_hits(self, view: IndexView, found: Sequence[tuple[str, bytes, bytes, Sequence[bytes]]],
                   flags: int) -> int | None:
        """Send the effects of Lookups answered here (policy touches, counters) one way, as HITS naming the
        entries (ns, ids, serials) found and the keys after them (a probe that stopped short): the daemon checks
        the entries and applies what holds, as for a PROBE. The send is also the check of the answer's source:
        the daemon's incarnation when it is the table's, else None (the table belongs to a daemon that is gone,
        or the connection was closed: ask the daemon)."""
        assert self.index is not None
        incarnation = self.channel.send_one_way(
            [(fp.HITS, fp.encode_probe(ns, ids, serials, tail), flags) for ns, ids, serials, tail in found],
            view.incarnation)
        if incarnation is not None and incarnation != view.incarnation:
            self.index.seen(view, incarnation)
        return incarnation if incarnation == view.incarnation else None

    def settle(self) -> None:
        """Wait until the daemon has applied this thread's HITS (answered here), before a Stats that counts them."""
        self.channel.settle()

    def release(self, lease_ids: list[int]) -> int:
        try:
            body = fp.encode_release(lease_ids)
        except UNENCODABLE:
            return self._grpc.release(lease_ids)
        return decoded_reply(fp.decode_count, self.channel.call(fp.RELEASE, body))

    def exists(self, namespace: str, keys: Sequence[bytes], cluster: bool = False) -> list[bool]:
        try:
            body = fp.encode_exists(namespace, keys)
        except UNENCODABLE:
            return self._grpc.exists(namespace, keys, cluster)
        return decoded_reply(fp.decode_bools,
                             self.channel.call(fp.EXISTS, body, fp.EXISTS_CLUSTER if cluster else 0))

    def echo(self, payload: bytes) -> bytes:
        """A round trip that does nothing in the daemon (the fast path's own cost, for bench.micro)."""
        return self.channel.call(fp.ECHO, payload)

    def close(self) -> None:
        self.channel.close()
