"""gRPC servicer: translates protobuf requests to engine calls and engine errors to gRPC statuses.

No decisions are made here. The only bytes this module touches are those of the Put/Get streams, the
fallback for clients that cannot map the arena; the hot path (Reserve/Commit/Lookup/Release) moves metadata.
Data-plane timing: each completed Put/Get stream is one "stream" transfer; Reserve -> Commit and a leasing
Lookup -> Release are "arena" transfers (see arena_windows.py). Both feed the daemon's TransferMeter.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import grpc
import numpy as np
import xxhash

from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.engine.engine import Engine
from kvstore.engine.quotas import TenantQuotas
from kvstore.engine.results import DiskWriting, KeyRecord
from kvstore.engine.sessions import SessionBook
from kvstore.engine.events import MOVED, REMOVED, STORED, Event
from kvstore.errors import IntegrityError, InvalidRequestError, KVStoreError, StoreFullError
from kvstore.pbmap import to_message
from kvstore.server.arena_windows import ArenaWindows
from kvstore.server.info import NodeInfo
from kvstore.server.ops import ControlOps
from kvstore.server.routing_ops import RoutingOps
from kvstore.server.routing_wire import node_score, origins_of
from kvstore.server.session_ops import SessionOps, session_explanation, session_info
from kvstore.server.tenancy import TenantGuard
from kvstore.server.tenant_usage import TenantUsage
from kvstore.tiers.disk.types import DiskStats
from kvstore.transfers import TransferMeter
from kvstore.validation import MAX_KEY_BYTES, MAX_SUBSCRIBE_NAMESPACES, check_count, check_namespace_name
from kvstore.vocab import ReserveOutcome

__all__ = ["KVStoreService", "STREAM_CHUNK_BYTES", "disk_tier_stats"]

log = logging.getLogger(__name__)

STREAM_CHUNK_BYTES = 1 << 20
# DiskStats fields the daemon keeps for metrics and logs but does not send in Stats (DiskTierStats lacks them)
_DISK_NOT_ON_WIRE = ("reads", "writes", "dropped_entries", "direct_io",
                     "reinserted_blocks", "quota_kept_blocks", "quota_overcommitted", "cleaned_segments")
F = TypeVar("F", bound=Callable[..., Any])


def _rpc(fn: F) -> F:
    """Turn a KVStoreError into its gRPC status + reason; log anything else and answer INTERNAL."""

    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: KVStoreService, request: Any, context: grpc.ServicerContext) -> Any:
        start = time.perf_counter()
        try:
            return fn(self, request, context)
        except KVStoreError as exc:
            _abort(context, exc)
        except Exception:
            log.exception("internal error in %s", name)
            context.set_trailing_metadata((("kvstore-reason", "internal"),))
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name}; see the daemon log")
        finally:
            self._observe(name, time.perf_counter() - start)

    return cast(F, wrapper)  # functools.wraps keeps fn's signature


def _abort(context: grpc.ServicerContext, exc: KVStoreError) -> None:
    log.info("rejected request: %s (%s)", exc.message, exc.reason)
    context.set_trailing_metadata((("kvstore-reason", exc.reason),))
    context.abort(getattr(grpc.StatusCode, exc.grpc_code), exc.message)


class KVStoreService(pb_grpc.KVStoreServicer):
    def __init__(self, engine: Engine, arena_view: np.ndarray, info: NodeInfo,
                 observe: Callable[[str, float], None] = lambda method, seconds: None, max_subscribers: int = 8,
                 transfers: TransferMeter | None = None, guard: TenantGuard | None = None,
                 tenants: TenantUsage | None = None, ops: ControlOps | None = None,
                 sessions: SessionBook | None = None, routing: RoutingOps | None = None) -> None:
        self._engine = engine
        self._guard = guard if guard is not None else TenantGuard(engine)  # tenancy.py: per-RPC ownership checks
        self._tenants = tenants if tenants is not None else TenantUsage(self._guard.owner_of, TenantQuotas(),
                                                                        TenantQuotas())
        self._view = arena_view
        self._info = info
        self._observe = observe  # RPC latency sink (the metrics histogram)
        self._max_subscribers = max_subscribers  # each Subscribe stream holds one RPC thread
        self._transfers = transfers if transfers is not None else TransferMeter()
        # the hot operations' semantics, shared with the same-node fast path (ops.py, fast_server.py)
        self.ops = ops if ops is not None else ControlOps(engine, self._guard, ArenaWindows(self._transfers))
        self.sessions = SessionOps(sessions if sessions is not None else SessionBook(), self.ops,
                                   engine.config.max_batch_keys)  # session_ops.py: the session book's RPCs
        # routing_ops.py: Annotate (vLLM identities for the vLLM-format events) and PrefixScore
        self.routing = routing if routing is not None else RoutingOps(engine, self._guard, info.node_id)

    @_rpc
    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        return self._info.health()

    @_rpc
    def RegisterNamespace(self, request: pb.RegisterNamespaceRequest, context: grpc.ServicerContext) -> pb.RegisterNamespaceResponse:
        tokens = request.tokens_per_block if request.HasField("tokens_per_block") else None
        tenant = self._guard.register(request.name, request.tenant)
        created = self._engine.register_namespace(request.name, request.model, request.layout_digest, tenant,
                                                  request.disk_codec, tokens)
        self._guard.registered(request.name, tenant)
        return pb.RegisterNamespaceResponse(created=created)

    @_rpc
    def Reserve(self, request: pb.ReserveRequest, context: grpc.ServicerContext) -> pb.ReserveResponse:
        r = self.ops.reserve(request.namespace, request.keys, request.sizes)
        return pb.ReserveResponse(reservation_id=r.reservation_id, outcomes=r.outcomes, offsets=r.offsets,
                                  expires_in_ms=r.expires_in_ms, incarnation=self._info.incarnation)

    @_rpc
    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitResponse:
        return pb.CommitResponse(committed=self.ops.commit(request.reservation_id, request.checksums))

    @_rpc
    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(aborted=self.ops.abort(request.reservation_id))

    @_rpc
    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        r = self.ops.lookup(request.namespace, request.keys, request.prefix, request.lease)
        return pb.LookupResponse(num_prefix=r.num_prefix, present=r.present, offsets=r.offsets, sizes=r.sizes,
                                 generations=r.generations, checksums=r.checksums, lease_id=r.lease_id, tiers=r.tiers,
                                 expires_in_ms=r.expires_in_ms, incarnation=self._info.incarnation)

    @_rpc
    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(released=self.ops.release(list(request.lease_ids)))

    @_rpc
    def Exists(self, request: pb.ExistsRequest, context: grpc.ServicerContext) -> pb.ExistsResponse:
        # a peer's own probe (grpc data plane) asks this node's tiers only: it must never fan out again
        cluster = request.cluster and ("kvstore-peer", "1") not in tuple(context.invocation_metadata() or ())
        return pb.ExistsResponse(present=self.ops.exists(request.namespace, request.keys, cluster=cluster))

    @_rpc
    def Claim(self, request: pb.ClaimRequest, context: grpc.ServicerContext) -> pb.ClaimResponse:
        # a peer's own claim (grpc data plane) is recorded here only: it must never fan out again
        local = ("kvstore-peer", "1") in tuple(context.invocation_metadata() or ())
        return pb.ClaimResponse(states=self.ops.claim(list(request.namespaces), request.keys, request.claimant,
                                                      request.ttl_ms, local_only=local))

    @_rpc
    def Delete(self, request: pb.KeysRequest, context: grpc.ServicerContext) -> pb.CountResponse:
        self._guard.namespace(request.namespace)
        return pb.CountResponse(count=self._engine.delete(request.namespace, request.keys))

    @_rpc
    def Pin(self, request: pb.KeysRequest, context: grpc.ServicerContext) -> pb.CountResponse:
        self._guard.namespace(request.namespace)
        return pb.CountResponse(count=self._engine.pin(request.namespace, request.keys, +1))

    @_rpc
    def Unpin(self, request: pb.KeysRequest, context: grpc.ServicerContext) -> pb.CountResponse:
        self._guard.namespace(request.namespace)
        return pb.CountResponse(count=self._engine.pin(request.namespace, request.keys, -1))

    @_rpc
    def ClearNamespace(self, request: pb.ClearNamespaceRequest, context: grpc.ServicerContext) -> pb.CountResponse:
        self._guard.namespace(request.namespace)
        return pb.CountResponse(count=self._engine.clear_namespace(request.namespace))

    @_rpc
    def ListKeys(self, request: pb.ListKeysRequest, context: grpc.ServicerContext) -> pb.ListKeysResponse:
        self._guard.namespace(request.namespace)
        if len(request.cursor) > MAX_KEY_BYTES:
            raise InvalidRequestError(f"cursor of {len(request.cursor)} bytes: a cursor is a key (1..{MAX_KEY_BYTES})")
        records, cursor = self._engine.list_keys(request.namespace, request.cursor, request.limit or 1000)
        tokens = self._engine.tokens_per_block(request.namespace)
        return pb.ListKeysResponse(keys=[_key_info(r, tokens) for r in records], next_cursor=cursor)

    @_rpc
    def Describe(self, request: pb.KeysRequest, context: grpc.ServicerContext) -> pb.ListKeysResponse:
        self._guard.namespace(request.namespace)
        records = self._engine.describe(request.namespace, request.keys)
        tokens = self._engine.tokens_per_block(request.namespace)
        return pb.ListKeysResponse(keys=[_key_info(r, tokens) for r in records])

    @_rpc
    def Explain(self, request: pb.KeysRequest, context: grpc.ServicerContext) -> pb.ExplainResponse:
        return pb.ExplainResponse(keys=[to_message(e, pb.KeyExplanation)
                                        for e in self.ops.explain(request.namespace, request.keys)])

    @_rpc
    def Hint(self, request: pb.HintRequest, context: grpc.ServicerContext) -> pb.HintResponse:
        return pb.HintResponse(outcomes=self.ops.hint(request.namespace, request.keys, request.action,
                                                      request.ttl_s))

    @_rpc
    def NoteSession(self, request: pb.NoteSessionRequest, context: grpc.ServicerContext) -> pb.NoteSessionResponse:
        kept = self.sessions.note(request.namespace, request.session, list(request.keys), request.ended)
        return pb.NoteSessionResponse(known=kept is not None, kept=kept or 0)

    @_rpc
    def ExplainSession(self, request: pb.ExplainSessionRequest,
                       context: grpc.ServicerContext) -> pb.ExplainSessionResponse:
        return pb.ExplainSessionResponse(entries=[session_explanation(x)
                                                  for x in self.sessions.explain(request.session, request.namespace)])

    @_rpc
    def ListSessions(self, request: pb.ListSessionsRequest, context: grpc.ServicerContext) -> pb.ListSessionsResponse:
        shown, total = self.sessions.listing(request.limit)
        return pb.ListSessionsResponse(sessions=[session_info(e, age) for e, age in shown], total=total,
                                       max_sessions=self.sessions.book.max_sessions)

    @_rpc
    def Annotate(self, request: pb.AnnotateRequest, context: grpc.ServicerContext) -> pb.AnnotateResponse:
        kept = self.routing.annotate(request.namespace, request.keys, origins_of(request))
        return pb.AnnotateResponse(publishing=self.routing.publishing, kept=kept)

    @_rpc
    def PrefixScore(self, request: pb.KeysRequest, context: grpc.ServicerContext) -> pb.PrefixScoreResponse:
        nodes, tokens = self.routing.prefix_score(request.namespace, request.keys)
        return pb.PrefixScoreResponse(nodes=[node_score(n, tokens) for n in nodes], tokens_per_block=tokens)

    @_rpc
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        """The engine's EngineStats by field name (kvstore.pbmap), plus what the daemon knows beyond the engine."""
        s = self._engine.stats()
        return to_message(
            s, pb.StatsResponse, node_id=self._info.node_id, arena=self._info.arena_info(),
            uptime_s=self._info.uptime_s(), namespaces=[n for n in s.namespaces if self._guard.owns(n.name)],
            tenants=self._tenants.rows(s.namespaces, only=self._guard.caller()), disk=self._disk_stats(s.disk),
            peers=self._info.peer_stats(), control=self._info.control_stats(),
        )

    def _disk_stats(self, d: DiskStats | None) -> pb.DiskTierStats | None:
        """None (no disk tier) leaves Stats.disk unset: the client reads it as None."""
        if d is None:
            return None
        return disk_tier_stats(d, self._engine.disk_directory, self._engine.write_queue_blocks,
                               self._engine.admission_name, self._engine.disk_writing())

    # -- byte streams (fallback path) ---------------------------------------------------------------------
    def Put(self, request_iterator: Iterator[pb.PutChunk], context: grpc.ServicerContext) -> pb.PutResponse:
        stored = present = received = 0
        writer: _StreamWriter | None = None  # the block being received, if any
        start = time.perf_counter()
        try:
            for chunk in request_iterator:
                part = chunk.WhichOneof("part")
                if part == "header":
                    if writer is not None:
                        raise InvalidRequestError("Put stream: a new header arrived before the previous block's data")
                    self._guard.namespace(chunk.header.namespace)
                    writer = _StreamWriter(self._engine, self._view, chunk.header)
                elif part == "data":
                    if writer is None:
                        raise InvalidRequestError("Put stream: data before any header; send a BlockHeader first")
                    received += len(chunk.data)
                    if writer.write(chunk.data):
                        stored += writer.stored is True
                        present += writer.stored is False
                        writer = None
                else:
                    raise InvalidRequestError("Put stream: empty chunk (neither header nor data)")
            if writer is not None:
                raise InvalidRequestError(
                    f"Put stream ended {writer.remaining} bytes short of the {writer.size} bytes its header announced"
                )
            self._transfers.observe("stream", "ram", "in", received, time.perf_counter() - start)
        except KVStoreError as exc:
            if writer is not None:
                writer.abort()
                writer = None
            _abort(context, exc)
        finally:
            if writer is not None:  # the client went away mid-block: free its slot now rather than at the TTL
                writer.abort()
            self._observe("Put", time.perf_counter() - start)
        return pb.PutResponse(stored=stored, already_present=present)

    def Subscribe(self, request: pb.SubscribeRequest, context: grpc.ServicerContext) -> Iterator[pb.KVEvent]:
        bus = self._engine.events
        if bus.streams >= self._max_subscribers:
            _abort(context, StoreFullError(f"{bus.streams} event subscribers already (max_subscribers="
                                           f"{self._max_subscribers}): close one or raise the limit"))
            return
        if request.buffer > 1 << 20:
            _abort(context, InvalidRequestError(f"buffer {request.buffer} too large: use 1..1048576 (0 = default)"))
            return
        try:
            check_count("namespaces", len(request.namespaces), MAX_SUBSCRIBE_NAMESPACES)
            for name in request.namespaces:
                check_namespace_name(name)
                self._guard.namespace(name)
        except KVStoreError as exc:
            _abort(context, exc)
            return
        filtered = self._guard.caller() is not None
        sub = bus.subscribe(list(request.namespaces), request.buffer)
        try:
            while context.is_active():
                ev = sub.next(timeout_s=0.5)
                if ev is not None and (not filtered or not ev.namespace or self._guard.owns(ev.namespace)):
                    yield _event_pb(ev, self._info.node_id)
        finally:
            sub.close()

    def Get(self, request: pb.KeysRequest, context: grpc.ServicerContext) -> Iterator[pb.GetChunk]:
        start = time.perf_counter()
        # a peer's fetch (grpc data plane) reads this node's own tiers only: it must never fan out again
        from_peer = ("kvstore-peer", "1") in tuple(context.invocation_metadata() or ())
        try:
            self._guard.namespace(request.namespace)
            r = self._engine.lookup(request.namespace, request.keys, prefix=False, lease=True, local_only=from_peer)
        except KVStoreError as exc:
            _abort(context, exc)
            return
        sent = 0
        try:
            hit = 0
            for key, present in zip(request.keys, r.present):
                if not present:
                    yield pb.GetChunk(header=pb.BlockHeader(namespace=request.namespace, key=key), found=False)
                    continue
                off, size = r.offsets[hit], r.sizes[hit]
                yield pb.GetChunk(header=pb.BlockHeader(namespace=request.namespace, key=key, size=size,
                                                        checksum=r.checksums[hit]), found=True)
                for pos in range(0, size, STREAM_CHUNK_BYTES):
                    end = min(size, pos + STREAM_CHUNK_BYTES)
                    yield pb.GetChunk(data=self._view[off + pos: off + end].tobytes())
                sent += size
                hit += 1
            self._transfers.observe("stream", "ram", "out", sent, time.perf_counter() - start)  # completed only
        finally:
            if r.lease_id:
                self._engine.release([r.lease_id])
            self._observe("Get", time.perf_counter() - start)


def disk_tier_stats(d: DiskStats, directory: str, write_queue_blocks: int, admission: str,
                    writing: DiskWriting | None = None) -> pb.DiskTierStats:
    """DiskStats by field name (kvstore.pbmap); what the engine adds is given, and the fields not on the wire
    are listed in _DISK_NOT_ON_WIRE."""
    extra: dict[str, object] = {}
    if writing is not None:
        extra = {"write_mode": writing.write_mode, "promotion_queue_blocks": writing.promotion_queue_blocks,
                 "writeback_blocks": writing.writeback_blocks}
        if writing.budget is not None:
            extra["budget"] = to_message(writing.budget, pb.DiskWriteBudget, enabled=True)
    return to_message(d, pb.DiskTierStats, ignore=_DISK_NOT_ON_WIRE, enabled=True, directory=directory,
                      write_queue_blocks=write_queue_blocks, admission=admission, **extra)


def _event_pb(ev: Event, node_id: str) -> pb.KVEvent:
    out = pb.KVEvent(seq=ev.seq, time=ev.time, node_id=node_id)
    if ev.kind == STORED:
        out.stored.CopyFrom(pb.BlockStored(namespace=ev.namespace, keys=ev.keys, tier=ev.tier))
    elif ev.kind == REMOVED:
        out.removed.CopyFrom(pb.BlockRemoved(namespace=ev.namespace, keys=ev.keys, tier=ev.tier,
                                             whole_namespace=ev.whole_namespace))
    elif ev.kind == MOVED:
        out.moved.CopyFrom(pb.BlockMoved(namespace=ev.namespace, keys=ev.keys, from_tier=ev.tier, to_tier=ev.to_tier))
    else:
        out.gap.CopyFrom(pb.Gap(dropped=ev.dropped))
    return out


def _key_info(r: KeyRecord, tokens: int) -> pb.KeyInfo:
    return to_message(r, pb.KeyInfo, tokens=tokens)


class _StreamWriter:
    """One block of a Put stream: reserve a slot, copy chunks into it, verify, commit (or abort)."""

    def __init__(self, engine: Engine, view: np.ndarray, header: pb.BlockHeader) -> None:
        self._engine, self._view, self._header = engine, view, header
        self.size = self.remaining = header.size
        self.stored: bool | None = None
        r = engine.reserve(header.namespace, [header.key], [header.size])
        self._rid = r.reservation_id
        self._pos = r.offsets[0]
        self._start = self._pos
        self._discard = r.outcomes[0] != ReserveOutcome.RESERVED

    def write(self, data: bytes) -> bool:
        """Consume one data chunk; True when the block is complete (then `stored` tells what happened)."""
        n = len(data)
        if n > self.remaining:
            raise InvalidRequestError(f"Put stream: {n - self.remaining} bytes more than the header's size")
        if not self._discard:
            self._view[self._pos: self._pos + n] = np.frombuffer(data, dtype=np.uint8)
        self._pos += n
        self.remaining -= n
        if self.remaining:
            return False
        if self._discard:
            self.stored = False
            return True
        block = self._view[self._start: self._start + self._header.size]
        digest = xxhash.xxh3_64_intdigest(block)  # type: ignore[arg-type]  # numpy's stubs do not declare ndarray a Buffer
        if self._header.checksum and digest != self._header.checksum:
            self._engine.note_checksum_failure()
            raise IntegrityError(f"Put stream: checksum mismatch for key {self._header.key.hex()}: bytes corrupted in flight")
        self._engine.commit(self._rid, [digest])
        self._rid = 0
        self.stored = True
        return True

    def abort(self) -> None:
        if self._rid:
            self._engine.abort(self._rid)
            self._rid = 0
