"""Client.note_session, Client.explain_session, Client.sessions: the daemon's session book (NoteSession,
ExplainSession, ListSessions; kvstore/engine/sessions.py says what the book keeps and for how long).

A mixin of Client (it needs only ``self._rpc`` and ``self.max_batch_keys``), so the session calls live in one
small file. gRPC only, like Explain and Hint: a note is one small control message per finished request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.rpc import Rpc
from kvstore.client.types import KeyExplanation
from kvstore.errors import BatchTooLargeError

__all__ = ["SessionCalls", "SessionExplanation", "SessionInfo"]


@dataclass(frozen=True)
class SessionInfo:
    """One entry of the session book (Client.sessions)."""

    session: str
    namespace: str
    blocks: int      # keys in its chain
    age_s: float     # seconds since it was last noted
    ended: bool      # released

    @staticmethod
    def from_pb(m: pb.SessionInfo) -> SessionInfo:
        return SessionInfo(m.session, m.namespace, m.blocks, m.age_s, m.ended)


@dataclass(frozen=True)
class SessionExplanation:
    """One entry of a session (one per shard namespace) and, per key of its chain, where it lives or why not."""

    session: str
    namespace: str
    keys: tuple[bytes, ...]
    explanations: tuple[KeyExplanation, ...]  # one per key, in chain order
    age_s: float
    ended: bool

    @staticmethod
    def from_pb(m: pb.SessionExplanation) -> SessionExplanation:
        return SessionExplanation(m.session, m.namespace, tuple(m.keys),
                                  tuple(KeyExplanation.from_pb(e) for e in m.explanations), m.age_s, m.ended)


class SessionCalls:
    """The session book's calls, mixed into Client."""

    _rpc: Rpc
    max_batch_keys: int

    def note_session(self, namespace: str, session: str, keys: Sequence[bytes], *, ended: bool = False) -> bool:
        """Record `keys` (the chain of the session's latest finished request) as the session's chain in
        `namespace`, and/or that it ended (released). False: nothing recorded (ended with no keys for a session
        the book does not hold). More keys than max_batch_keys: BatchTooLargeError (note the chain's head)."""
        if len(keys) > self.max_batch_keys:
            raise BatchTooLargeError(f"{len(keys)} keys in one session note exceeds max_batch_keys="
                                     f"{self.max_batch_keys}: note the chain's head (keys[:max_batch_keys])")
        r = self._rpc.call("NoteSession", pb.NoteSessionRequest(namespace=namespace, session=session, keys=keys,
                                                                ended=ended))
        return bool(r.known)

    def explain_session(self, session: str, namespace: str = "") -> list[SessionExplanation]:
        """The session's entries (every namespace holding it, or `namespace`'s), most recently noted first, each
        explained key by key like Client.explain. A session the book does not hold: a NOT_FOUND KVStoreError
        whose message says how sessions are noted."""
        r = self._rpc.call("ExplainSession", pb.ExplainSessionRequest(session=session, namespace=namespace))
        return [SessionExplanation.from_pb(e) for e in r.entries]

    def sessions(self, limit: int = 0) -> tuple[list[SessionInfo], int]:
        """(the session book's entries this caller may see, most recently noted first, at most `limit` (0: all);
        how many it may see in all)."""
        r = self._rpc.call("ListSessions", pb.ListSessionsRequest(limit=limit))
        return [SessionInfo.from_pb(s) for s in r.sessions], r.total
