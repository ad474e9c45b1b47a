"""The data-plane interface between peers; one implementation per transport, chosen by `peer_data_plane`.

    DataPlane
      start() / stop()           the listener peers dial (none for grpc: the control port serves it)
      address                    what this node advertises as its data address
      fetch(member, ns, keys)    one batched call: blocks the member has land in local arena slots;
                                 returns how many were stored here (the rest are misses)
      push(member, desc, keys, handoff)
                                 one batched call: send these local blocks; returns how many it stored.
                                 `handoff`: they move to a new owner after a membership change (the tcp and
                                 ucx receivers take only blocks they own; grpc's Put stream cannot say so)
      probe(member, ns, keys)    one batched call, metadata only: which keys the member holds (a scheduler's
                                 Lookup asks this, then fetches in the background: remote_tier.py)
      probe_many(calls)          several probes (to several peers) at once; a plane that can send them all
                                 from the calling thread and then read the answers says so
                                 (`pipelines_probes`), otherwise the caller spreads them over its threads
      claim(member, ns, keys, claimant, ttl_ms)
                                 a probe that also claims the keys the member misses for a scheduler that is
                                 about to compute them; per key CLAIMED, HELD or PENDING (engine/claims.py)
      probe_tiers(member, ns, keys), probe_tiers_many(calls)
                                 the same, answering each key's tier at the member (NONE, RAM, DISK): a
                                 router's prefix score asks every member (scores.py)

Every call is bounded by `timeout_s` as a whole (one deadline from its start, re-armed before every receive,
never a timeout that restarts with each byte: deadline.py) and raises PeerTimeout or PeerError (both
PeerCallError); the caller counts them and treats the keys as misses / the pushes as dropped. The TCP and UCX
planes also never write a received byte into a reserved slot after that reservation's safe end (local.py
`live_until`). The TCP and UCX planes share one protocol (protocol.py: what to send, what a reply must be,
how a request is served, where received bytes land) and differ only in how bytes move. Implementations:
tcp_plane.TcpPlane (framed protocol, recv_into arena slots, sends from slots), ucx_plane.UcxPlane (ucxx),
grpc_plane.GrpcPlane (the daemon's own Get/Put streams, the last fallback).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvstore.peer.frames import NamespaceDesc
from kvstore.peer.membership import Member

__all__ = ["DataPlane", "PeerCallError", "PeerTimeout", "PeerError"]


class PeerCallError(Exception):
    """A call to a peer failed; its keys are misses (fetch) or its blocks are dropped (push)."""


class PeerTimeout(PeerCallError):
    """The peer did not answer, or finish answering, within timeout_s of the call's start."""


class PeerError(PeerCallError):
    """Refused, reset, or an answer that broke the protocol."""


class DataPlane(ABC):
    name: str = ""
    pipelines_probes: bool = False  # probe_many sends every request before reading any answer

    def probe_many(self, calls: list[tuple[Member, str, list[bytes]]]) -> list[list[bool] | PeerCallError]:
        """Per call, its probe's answer or the PeerCallError it raised; one after another unless the plane
        pipelines them (then it overrides this)."""
        out: list[list[bool] | PeerCallError] = []
        for member, namespace, keys in calls:
            try:
                out.append(self.probe(member, namespace, keys))
            except PeerCallError as exc:
                out.append(exc)
        return out

    def probe_tiers_many(self, calls: list[tuple[Member, str, list[bytes]]]) -> list[list[int] | PeerCallError]:
        """Per call, its tiers probe's answer or the PeerCallError it raised (as probe_many)."""
        out: list[list[int] | PeerCallError] = []
        for member, namespace, keys in calls:
            try:
                out.append(self.probe_tiers(member, namespace, keys))
            except PeerCallError as exc:
                out.append(exc)
        return out

    @property
    @abstractmethod
    def address(self) -> str: ...

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def stop(self) -> None: ...

    @abstractmethod
    def fetch(self, member: Member, namespace: str, keys: list[bytes]) -> int: ...

    @abstractmethod
    def push(self, member: Member, desc: NamespaceDesc, keys: list[bytes], handoff: bool = False) -> int: ...

    @abstractmethod
    def probe(self, member: Member, namespace: str, keys: list[bytes]) -> list[bool]: ...

    @abstractmethod
    def claim(self, member: Member, namespace: str, keys: list[bytes], claimant: bytes, ttl_ms: int) -> list[int]: ...

    @abstractmethod
    def probe_tiers(self, member: Member, namespace: str, keys: list[bytes]) -> list[int]: ...
