"""`kvstore.Client`: the Python API of the store.

On the daemon's host the client maps the arena and copies bytes itself (data_calls.py: a put into spare slots and
one Store, a get from the key index, else Reserve -> copy -> Commit and Lookup -> copy -> Release); elsewhere, or
with mode="stream", bytes go through the streaming Put/Get RPCs.
Both paths give the same results, so callers never choose.

High-level calls (put, put_many, get, get_many, get_into, get_many_into, lookup_prefix, exists, delete, pin,
unpin, clear, stats, keys, describe, explain, hint, annotate) split batches larger than the daemon's max_batch_keys. Low-level
calls (reserve, commit, abort, lookup, release) are the two-phase primitives the vLLM connector drives directly.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from kvstore._proto import kvstore_pb2 as pb
from kvstore.client import arena_path, connect, hinting, listing, probes, spare_puts
from kvstore.client.arena_map import ArenaMap
from kvstore.client.batches import chunks
from kvstore.client.arena_slot import ArenaSlot
from kvstore.client.control import ControlPlane, FastControl, GrpcControl
from kvstore.client.events import EventStream  # re-exported: kvstore.client imports it from here
from kvstore.client.releaser import Releaser
from kvstore.client.rpc import Rpc
from kvstore.client.slot_bank import SlotBank
from kvstore.client.data_calls import DataCalls  # put, put_many, get, get_many, get_into, get_many_into
from kvstore.client.routing import RoutingCalls  # annotate, prefix_score, kv_events
from kvstore.client.sessions import SessionCalls  # note_session, explain_session, sessions
from kvstore.client.types import Health, KeyExplanation, KeyInfo, Lease, Reservation, Stats
from kvstore.errors import ConfigError, InvalidRequestError, KVStoreError, StoreUnavailableError
from kvstore.hint_vocab import HintAction, HintOutcome
from kvstore.paths import default_address
from kvstore.security.tls import TlsFiles
from kvstore.validation import check_tokens_per_block

__all__ = ["Client", "EventStream"]

log = logging.getLogger(__name__)
_MODES = ("auto", "arena", "stream")
_CONTROLS = ("auto", "fast", "grpc")


class Client(DataCalls, SessionCalls, RoutingCalls):
    """A connection to one kvstore-server. Thread-safe for concurrent calls; close() or use `with`.

    `copy_threads` splits each batched arena copy over that many threads (in 1 MiB chunks; copies under 24 MiB stay
    on one). Two measured ~15-25 % faster than one for 32 x 2 MiB on a 2-core machine: one core cannot
    saturate memory bandwidth.
    """

    def __init__(self, address: str | None = None, *, mode: str = "auto", timeout_s: float = 10.0,
                 copy_threads: int = 2, token_file: str | None = None, tls: TlsFiles | None = None,
                 control: str | None = None, spare_slots: bool | None = None) -> None:
        """`token_file` (default $KVSTORE_TOKEN_FILE): owner-only file with this tenant's bearer token.
        `tls` (default from $KVSTORE_TLS_CA / _CERT / _KEY): CA to trust and optional client certificate for a
        TCP address (mutual TLS); unix sockets never use TLS.
        `control` (default $KVSTORE_CONTROL, else "auto"): how Reserve/Commit/Abort/Lookup/Release/Exists travel:
        "fast" over the daemon's same-node socket (kvstore/fastpath), "grpc", or "auto" (fast on the daemon's
        host when its socket answers, else gRPC). Everything else is always gRPC.
        `spare_slots` (default $KVSTORE_SPARE_SLOTS, else on): on the fast path, puts copy into arena slots the
        connection holds ahead and store with one request (kvstore/client/spare_puts.py); off, they reserve."""
        if mode not in _MODES:
            raise ConfigError(f"mode={mode!r}: use one of {', '.join(_MODES)}")
        control = control or os.environ.get("KVSTORE_CONTROL") or "auto"
        if control not in _CONTROLS:
            raise ConfigError(f"control={control!r}: use one of {', '.join(_CONTROLS)} (or unset KVSTORE_CONTROL)")
        self.address = address or default_address()
        self._rpc = Rpc(self.address, timeout_s, tls=tls, token_file=token_file)
        self._copy_threads = copy_threads
        self._requested_mode = mode
        self._slot = ArenaSlot()  # the arena mapping: replaced (never unmapped under a copy) on a restart
        self._left_incarnations: set[int] = set()  # daemon incarnations this client mapped and moved on from
        self._connect_lock = threading.Lock()  # one reconnect at a time
        self._requested_control = control
        self._spare_slots = spare_puts.spares_wanted(spare_slots)
        self._grpc = GrpcControl(self._rpc)
        self._control: ControlPlane = self._grpc
        self._releaser = Releaser(lambda ids: self._control.release(ids))
        try:
            self._connect()
        except BaseException:
            self._rpc.close()
            raise

    # -- connection -------------------------------------------------------------------------------------
    def _connect(self) -> None:
        with self._connect_lock:
            h = self._rpc.call("Health", pb.HealthRequest())
            self._health = h
            self.max_batch_keys = h.max_batch_keys or 4096
            self.max_block_bytes = h.max_block_bytes
            self._set_control(connect.open_fast(h, self._rpc, self._grpc, self._requested_control))
            new: ArenaMap | None = None
            self._slot.retry_at = None
            if self._requested_mode != "stream":
                patience = min(self._rpc.timeout_s, connect.ARENA_PATIENCE_S)
                new, why, transient = connect.map_arena_patiently(h, self._rpc, patience)
                if new is None and self._requested_mode == "arena":
                    self._slot.swap(None)
                    raise StoreUnavailableError(f"mode='arena' but {why}; use mode='auto' or 'stream'")
                if new is None:
                    self._slot.retry_at = connect.streaming_because(why, transient)
            self._slot.swap(new)

    def _current_arena(self) -> ArenaMap | None:
        """The mapping the data path should use now. In auto mode after a transient handoff failure (the daemon's
        socket did not answer), the handoff is retried every ARENA_RETRY_S (connect.py): not streamed for good."""
        if self._slot.retry_due():
            self._retry_arena()
        return self._slot.map

    def _retry_arena(self) -> None:
        if not self._connect_lock.acquire(blocking=False):
            return  # a reconnect is under way: it decides
        try:
            if self._slot.retry_due():
                self._slot.retry_at = time.monotonic() + connect.ARENA_RETRY_S
                h, new, keep_trying = connect.remap_arena(self._rpc)
                if new is not None:
                    self._health = h
                    self._slot.swap(new)
                if not keep_trying:
                    self._slot.retry_at = None
        finally:
            self._connect_lock.release()

    def _set_control(self, fast: FastControl | None) -> None:
        if fast is not None:
            fast.generations = self._slot.generations
            fast.spares = self._spare_slots
        old, self._control = self._control, (fast if fast is not None else self._grpc)
        if old is not self._grpc and old is not self._control:
            old.close()

    @property
    def control_path(self) -> str:
        """'fast' when the hot operations go over the daemon's same-node socket, else 'grpc'."""
        return self._control.name

    @property
    def probe_path(self) -> str:
        """"index" when prefix probes read the daemon's shared key index first (fast path, the daemon offers one,
        $KVSTORE_KEY_INDEX is not 0), else "daemon" (see kvstore/client/shared_index.py)."""
        index = getattr(self._control, "index", None)
        return "index" if index is not None and index.view() is not None else "daemon"

    def _check_incarnation(self, incarnation: int) -> None:
        """The daemon restarted since we mapped its arena: map the new one before using any offset."""
        current = self._slot.map
        if current is not None and incarnation != current.incarnation:
            with self._connect_lock:
                if self._slot.map is not current:  # another thread already remapped
                    return
            log.warning("kvstore daemon at %s restarted; remapping its arena", self.address)
            self._left_incarnations.add(current.incarnation)
            self._connect()

    def acquire_arena(self, incarnation: int | None = None) -> ArenaMap | None:
        """The current arena mapping with a reference taken, or None (stream mode; or the mapping belongs to
        another daemon incarnation than `incarnation`, the one a reservation or lease came from).

        For callers that copy with their own engine (the vLLM connector's gather/scatter, GPU DMA): every copy
        through `m.address + offset` must finish before `m.release()` (or use `with m:`), so a concurrent
        reconnect or close() can never unmap memory under it (arena_map.py).

        A lease or reservation of a daemon incarnation this client has not mapped yet (another process, vLLM's
        scheduler, met the restarted daemon first and passed its lease on) makes the client map the new arena
        first, once: without it the first load after a restart found no mapping and fell back to recompute.
        An incarnation the client has already left is stale and gets None without a reconnect."""
        m = self._slot.acquire(incarnation)
        current = self._slot.map
        if (m is None and incarnation is not None and current is not None and incarnation != current.incarnation
                and incarnation not in self._left_incarnations):
            self._left_incarnations.add(current.incarnation)
            self._check_incarnation(incarnation)
            m = self._slot.acquire(incarnation)
        return m

    @property
    def mode(self) -> str:
        """'arena' when bytes move through shared memory, else 'stream' (which may retry the arena first: see
        _current_arena)."""
        return "arena" if self._current_arena() is not None else "stream"

    @property
    def arena_span(self) -> tuple[int, int] | None:
        """(base address, bytes) of the current mapping; None in stream mode. Informational: to copy through
        it, hold a reference (acquire_arena), since a reconnect may replace the mapping at any time."""
        m = self._slot.map
        return (m.address, m.size) if m is not None else None

    @property
    def arena_incarnation(self) -> int | None:
        m = self._slot.map
        return m.incarnation if m is not None else None

    def lease_valid(self, lease: Lease) -> list[bool]:
        """Per hit of `lease`: True when its slot still holds the leased block, checked after a copy made
        outside the client (False: the lease expired mid-copy, or the daemon restarted: treat as a miss)."""
        if self._slot.map is None:
            raise InvalidRequestError("lease_valid needs the arena data path (mode='arena')")
        m = self.acquire_arena(lease.incarnation)
        if m is None:
            return [False] * lease.hits
        with m:
            return [v is not None for v in arena_path.validated(m, lease, [1] * lease.hits)]

    @property
    def tenant(self) -> str:
        """The tenant this client's token belongs to, as the daemon said on connecting ("" without tokens)."""
        return self._health.tenant

    def health(self) -> Health:
        """The daemon's health, plus which paths this client uses (client_control, client_data, client_probe)."""
        h = Health.from_pb(self._rpc.call("Health", pb.HealthRequest()))
        return dataclasses.replace(h, client_control=self.control_path, client_data=self.mode,
                                   client_probe=self.probe_path)

    def close(self) -> None:
        self._releaser.close(self._rpc.timeout_s)
        self._slot.swap(None)  # copies still running in other threads keep the old mapping until they finish
        self._set_control(None)
        self._rpc.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- namespaces -------------------------------------------------------------------------------------
    def register_namespace(self, name: str, *, model: str = "", layout_digest: str = "", tenant: str = "",
                           disk_codec: str = "", tokens_per_block: int | None = None) -> bool:
        """Declare a namespace (idempotent). True when this call created it.

        disk_codec picks the disk-tier compression of its blocks: "" (the daemon's default), "none", "zstd",
        or "zstd-shuffle2" (byte-shuffled for 16-bit data such as bf16 KV).
        tokens_per_block (1..1048576, vLLM's block_size) lets the daemon report lookups and hits in tokens;
        None leaves it unknown. A value other than the registered one raises ConflictError.
        """
        check_tokens_per_block(tokens_per_block)
        req = pb.RegisterNamespaceRequest(name=name, model=model, layout_digest=layout_digest, tenant=tenant,
                                          disk_codec=disk_codec, tokens_per_block=tokens_per_block)
        return self._rpc.call("RegisterNamespace", req).created

    # -- two-phase primitives ---------------------------------------------------------------------------
    def reserve(self, namespace: str, keys: Sequence[bytes], sizes: Sequence[int]) -> Reservation:
        r = self._control.reserve(namespace, keys, sizes)
        self._check_incarnation(r.incarnation)
        return r

    def reserve_many(self, requests: Sequence[tuple[str, Sequence[bytes], Sequence[int]]]
                     ) -> list[Reservation | KVStoreError]:
        """Several (namespace, keys, sizes) Reserves at once, pipelined over the fast path (one round trip); a
        refused one comes back as its KVStoreError in its slot, the others stand (commit or abort each)."""
        out = self._control.reserve_many(requests)
        for r in out:
            if isinstance(r, Reservation):
                self._check_incarnation(r.incarnation)
        return out

    def slot_bank(self, size: int) -> SlotBank | None:
        """Spare slots for blocks of `size` bytes that one thread takes and copies into and another stores
        (kvstore/client/slot_bank.py: the vLLM connector's saves); None off the fast path's arena, or with spare
        slots off."""
        return self._control.slot_bank(size, self._check_incarnation) if self.mode == "arena" else None

    def commit(self, reservation: Reservation, checksums: Sequence[int] = ()) -> int:
        if not reservation.id:
            return 0
        return self._control.commit(reservation.id, checksums)

    def abort(self, reservation: Reservation) -> int:
        if not reservation.id:
            return 0
        return self._control.abort(reservation.id)

    def lookup(self, namespace: str, keys: Sequence[bytes], *, prefix: bool = False, lease: bool = True) -> Lease:
        r = self._control.lookup(namespace, keys, prefix, lease)
        self._check_incarnation(r.incarnation)
        return r

    def release(self, leases: Sequence[Lease], *, wait: bool = False) -> None:
        """Give leases back. Asynchronous by default: the caller has its bytes and need not wait."""
        ids = [lease.id for lease in leases if lease.id]
        if not ids:
            return
        if wait:
            self._control.release(ids)
        else:
            self._releaser.submit(ids)

    def echo(self, payload: bytes = b"") -> bytes:
        """One round trip on the control path that does nothing in the daemon (measures the path itself)."""
        if isinstance(self._control, FastControl):
            return self._control.echo(payload)
        self._rpc.call("Health", pb.HealthRequest())
        return payload

    def lookup_prefix(self, namespace: str, keys: Sequence[bytes]) -> int:
        """How many leading keys of a chain are stored (no lease taken)."""
        return self.probe_prefix(namespace, keys)[0]

    def probe_prefix(self, namespace: str, keys: Sequence[bytes]) -> tuple[int, bool]:
        """(how many leading keys of a chain are stored, whether all of those are in this node's RAM), with
        no lease taken. RAM hits load with one memcpy; disk and peer hits wait for a promotion or a fetch
        (started by this probe), which a caller may rather wait for off its critical path."""
        return self.probe_prefix_many([namespace], keys)

    def probe_prefix_many(self, namespaces: Sequence[str], keys: Sequence[bytes]) -> tuple[int, bool]:
        """probe_prefix over several namespaces at once (the shards of one model: TP ranks, pipeline stages):
        (leading keys every namespace holds, whether all of those are in RAM in every one); see probes.py."""
        return probes.common_prefix(self._control, self._check_incarnation, self.max_batch_keys, namespaces, keys)

    def probe_prefix_tiers(self, namespaces: Sequence[str], keys: Sequence[bytes]) -> tuple[int, list[int]]:
        """probe_prefix_many, with the tier each common key comes from (the farthest over the namespaces:
        RAM, DISK or PEER, kvstore.vocab.Tier) instead of one all-in-RAM flag."""
        return probes.common_prefix_tiers(self._control, self._check_incarnation, self.max_batch_keys, namespaces,
                                          keys)

    def probe_tiers_many(self, namespaces: Sequence[str], keys: Sequence[bytes]) -> list[list[int]]:
        """Each key's tier in each namespace (kvstore.vocab.Tier; NONE: absent), no lease taken, pipelined over
        the namespaces like probe_prefix_many: the window a sliding-window KV cache group needs (probes.py)."""
        return probes.tiers_many(self._control, self._check_incarnation, self.max_batch_keys, namespaces, keys)

    # -- management -------------------------------------------------------------------------------------
    def exists(self, namespace: str, keys: Sequence[bytes], *, cluster: bool = False) -> list[bool]:
        """Per key: held by this daemon (RAM, disk). `cluster`: or by its owner on the peer tier (one
        metadata-only probe per peer for the keys missing here; no bytes move, no lookup is counted)."""
        out: list[bool] = []
        for part in chunks(len(keys), self.max_batch_keys):
            out.extend(self._control.exists(namespace, list(keys[part]), cluster))
        return out

    def claim(self, namespaces: Sequence[str], keys: Sequence[bytes], claimant: bytes, ttl_ms: int) -> list[int]:
        """Claim `keys` (a prompt's keys from its first miss) for the scheduler `claimant`, which is about to
        compute and save them, in every namespace of one model's shards: per key CLAIMED (compute it), HELD
        (load it) or PENDING (another claimant computes it now: wait for its save, then load it); kvstore's
        engine/claims.py. With a peer tier the claim is recorded at each key's owner too (one round trip)."""
        out: list[int] = []
        for part in chunks(len(keys), self.max_batch_keys):
            r = self._rpc.call("Claim", pb.ClaimRequest(namespaces=list(namespaces), keys=list(keys[part]),
                                                         claimant=claimant, ttl_ms=ttl_ms))
            out.extend(r.states)
        return out

    def _count(self, rpc: str, namespace: str, keys: Sequence[bytes]) -> int:
        return sum(self._rpc.call(rpc, pb.KeysRequest(namespace=namespace, keys=keys[p])).count
                   for p in chunks(len(keys), self.max_batch_keys))

    def delete(self, namespace: str, keys: Sequence[bytes]) -> int:
        return self._count("Delete", namespace, keys)

    def pin(self, namespace: str, keys: Sequence[bytes]) -> int:
        return self._count("Pin", namespace, keys)

    def unpin(self, namespace: str, keys: Sequence[bytes]) -> int:
        return self._count("Unpin", namespace, keys)

    def clear(self, namespace: str) -> int:
        return self._rpc.call("ClearNamespace", pb.ClearNamespaceRequest(namespace=namespace)).count

    def stats(self) -> Stats:
        """The daemon's counters, including the effects of this thread's probes answered from the key index."""
        self._control.settle()
        return Stats.from_pb(self._rpc.call("Stats", pb.StatsRequest()))

    def subscribe(self, namespaces: Sequence[str] = (), *, buffer: int = 0) -> EventStream:
        """Tail the daemon's KV events (all namespaces by default). Iterate it; close() (or `with`) to stop.

        A subscriber that reads too slowly gets a `gap` event counting what it missed; the store never waits.
        """
        return EventStream.open(self._rpc, namespaces, buffer)

    def describe(self, namespace: str, keys: Sequence[bytes]) -> list[KeyInfo | None]:
        """Where and how each key is stored (None when absent)."""
        return listing.describe(self._rpc, namespace, keys, self.max_batch_keys)

    def explain(self, namespace: str, keys: Sequence[bytes]) -> list[KeyExplanation]:
        """Per key: the tier it lives in now, or why it is absent (cause, age, policy, other namespaces).
        Read-only like describe: counts no lookup, touches no eviction order, starts no promotion."""
        return listing.explain(self._rpc, namespace, keys, self.max_batch_keys)

    def hint(self, namespace: str, keys: Sequence[bytes], action: HintAction | str,
             ttl_s: float = 0.0) -> list[HintOutcome]:
        """An agent's hint (retain, release, demote, prefetch, pin; ttl_s for retain and pin): one outcome per
        key (kvstore.hint_vocab). A bad action or ttl: InvalidRequestError; the daemon keeps serving."""
        return hinting.hint(self._rpc, namespace, keys, action, ttl_s, self.max_batch_keys)

    def keys(self, namespace: str, *, start_after: bytes = b"", limit: int | None = None,
             page_size: int = 1000) -> Iterator[KeyInfo]:
        """Keys of a namespace in byte order (after `start_after`, exclusive), fetched page by page."""
        return listing.keys(self._rpc, namespace, start_after, limit, page_size)
