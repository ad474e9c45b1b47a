"""The hot operations' semantics, once: tenant checks, the engine call, arena transfer windows.

Two front ends call these: the gRPC service (service.py) and the same-node fast path (fast_server.py). Each only
translates its wire format to these calls and their results or KVStoreErrors back; nothing here knows either
format. The caller's tenant is the `current_tenant` context variable (auth.py), set by the front end once it
has checked the caller's token. Explain (why a key is missing) is gRPC only, but its tenant filtering is an
ownership rule like the others, so it lives here too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kvstore.engine.claims import CLAIMED, HELD, PENDING
from kvstore.engine.engine import Engine
from kvstore.engine.misses import NEVER_STORED, OTHER_NAMESPACE, KeyExplanation
from kvstore.engine.results import LookupResult, ReserveResult, StoreResult
from kvstore.server.arena_windows import ArenaWindows
from kvstore.server.tenancy import TenantGuard
from kvstore.errors import InvalidRequestError
from kvstore.validation import MAX_RELEASE_IDS, check_count
from kvstore.vocab import ReserveOutcome

__all__ = ["ControlOps"]

MAX_CLAIM_NAMESPACES = 64  # one model's shards (pipeline stages x TP ranks); a Claim naming more is refused


class ControlOps:
    def __init__(self, engine: Engine, guard: TenantGuard, windows: ArenaWindows) -> None:
        self.engine = engine
        self.guard = guard
        self.windows = windows

    def reserve(self, namespace: str, keys: Sequence[bytes], sizes: Sequence[int]) -> ReserveResult:
        self.guard.namespace(namespace)
        r = self.engine.reserve(namespace, keys, sizes)
        reserved = sum(s for s, o in zip(sizes, r.outcomes) if o == ReserveOutcome.RESERVED)
        self.windows.reserved(r.reservation_id, reserved)
        return r

    def commit(self, reservation_id: int, checksums: Sequence[int], settle_later: bool = False) -> int:
        """`settle_later`: the caller sends the reply, then calls `settle` (the eviction waits; engine_lock.py)."""
        self.guard.reservation(reservation_id)
        committed = self.engine.commit(reservation_id, checksums, settle_later)
        self.windows.committed(reservation_id)
        return committed

    def abort(self, reservation_id: int) -> int:
        self.guard.reservation(reservation_id)
        aborted = self.engine.abort(reservation_id)
        self.windows.aborted(reservation_id)
        return aborted

    def spare(self, owner: int, size: int, count: int) -> tuple[int, list[int]]:
        """Engine.spare: slots held by connection `owner`, in the caller's tenant's memory."""
        return self.engine.spare(owner, size, count, self.guard.caller() or "")

    def store(self, owner: int, namespace: str, keys: Sequence[bytes], sizes: Sequence[int],
              offsets: Sequence[int], settle_later: bool = False) -> StoreResult:
        """Engine.store: blocks copied into `owner`'s spare slots, stored in one step; `settle_later` as for
        commit."""
        self.guard.namespace(namespace)
        r = self.engine.store(owner, namespace, keys, sizes, offsets, settle_later)
        self.windows.unwindowed("in", sum(sizes) if r.stored == len(sizes) else
                                sum(s for s, o in zip(sizes, r.outcomes) if o == ReserveOutcome.RESERVED))
        return r

    def drop_spares(self, owner: int) -> int:
        return self.engine.drop_spares(owner)

    def settle(self) -> None:
        """Engine.settle: what a Commit or Store left for after its reply (a no-op when nothing is left)."""
        self.engine.settle()

    def lookup(self, namespace: str, keys: Sequence[bytes], prefix: bool, lease: bool,
               summary: bool = False) -> LookupResult:
        """`summary`: counts only (see Engine.lookup); the fast path's prefix probes ask for it."""
        self.guard.namespace(namespace)
        r = self.engine.lookup(namespace, keys, prefix, lease, summary=summary)
        self.windows.leased(r.lease_id, sum(r.sizes))
        return r

    def probe(self, namespace: str, prior_ids: np.ndarray, prior_serials: np.ndarray,
              tail: Sequence[bytes], read: bool = False) -> LookupResult:
        """Engine.probe: a prefix probe whose leading keys the caller found in its shared key index."""
        self.guard.namespace(namespace)
        r = self.engine.probe(namespace, prior_ids, prior_serials, tail, read)
        self.windows.unwindowed("out", r.read_bytes)
        return r

    def lookup_entries(self, namespace: str, ids: np.ndarray, serials: np.ndarray, prefix: bool, lease: bool,
                       summary: bool = False) -> LookupResult | None:
        """Engine.lookup_entries: a Lookup of keys the caller found in its shared key index (None: ask again)."""
        self.guard.namespace(namespace)
        r = self.engine.lookup_entries(namespace, ids, serials, prefix, lease, summary)
        if r is not None:
            self.windows.leased(r.lease_id, sum(r.sizes))
        return r

    def release(self, lease_ids: Sequence[int]) -> int:
        check_count("lease ids", len(lease_ids), MAX_RELEASE_IDS)
        own = self.guard.own_leases(list(lease_ids))
        released = self.engine.release(own)
        self.windows.released(own)
        return released

    def exists(self, namespace: str, keys: Sequence[bytes], cluster: bool = False) -> list[bool]:
        self.guard.namespace(namespace)
        return self.engine.exists(namespace, keys, cluster=cluster)

    def claim(self, namespaces: Sequence[str], keys: Sequence[bytes], claimant: bytes, ttl_ms: int,
              local_only: bool = False) -> list[int]:
        """Engine.claim in each of the caller's namespaces (one model's shards), folded per key: CLAIMED where
        any shard's is (the caller computes the key, so every shard saves it), else PENDING where any shard
        waits, else HELD (kvstore/engine/claims.py)."""
        if not namespaces:
            raise InvalidRequestError("a Claim names no namespace")
        check_count("namespaces", len(namespaces), MAX_CLAIM_NAMESPACES)
        for ns in namespaces:
            self.guard.namespace(ns)
        per = [self.engine.claim(ns, keys, claimant, ttl_ms, local_only) for ns in namespaces]
        return [CLAIMED if CLAIMED in col else (PENDING if PENDING in col else HELD) for col in zip(*per)]

    def explain(self, namespace: str, keys: Sequence[bytes]) -> list[KeyExplanation]:
        """Engine.explain, with another tenant's namespaces left out of other_namespaces: a key held only by
        another tenant is "never_stored" to this caller (that tenant's keys and names must not leak)."""
        self.guard.namespace(namespace)
        out = self.engine.explain(namespace, keys)
        if self.guard.caller() is None:
            return out
        return [_own_holders(e, self.guard) for e in out]

    def hint(self, namespace: str, keys: Sequence[bytes], action: str, ttl_s: float) -> list[str]:
        """Engine.hint (one HintOutcome value per key) on the caller's own namespace only: another tenant's
        namespace is unknown to it, as for Describe and Explain (its blocks must not be steered by others)."""
        self.guard.namespace(namespace)
        return self.engine.hint(namespace, keys, action, ttl_s)


def _own_holders(e: KeyExplanation, guard: TenantGuard) -> KeyExplanation:
    if not e.other_namespaces:
        return e
    own = tuple(n for n in e.other_namespaces if guard.owns(n))
    cause = NEVER_STORED if e.cause == OTHER_NAMESPACE and not own else e.cause
    return dataclasses.replace(e, cause=cause, other_namespaces=own)
