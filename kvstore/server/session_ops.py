"""The session book's RPCs (NoteSession, ExplainSession, ListSessions): input checks, tenancy, and Explain reused.

The book itself (kvstore/engine/sessions.py) knows nothing of tenants or wire formats. Here a note is checked
like any other request (a registered namespace the caller owns, valid keys, a valid session id), and a caller
sees only the entries of its own namespaces: another tenant's session is as unknown as one never noted.
Explaining an entry is ControlOps.explain on its chain, so it answers exactly what `kvstore explain NAMESPACE
KEY...` would (read-only: no lookup counted, no eviction order touched).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore._proto import kvstore_pb2 as pb
from kvstore.engine.misses import KeyExplanation
from kvstore.engine.sessions import SessionBook, SessionEntry, check_session_id
from kvstore.server.ops import ControlOps
from kvstore.errors import BatchTooLargeError, UnknownSessionError
from kvstore.pbmap import to_message
from kvstore.validation import check_keys, check_namespace_name

__all__ = ["SessionOps", "ExplainedSession", "session_explanation", "session_info"]


@dataclass(frozen=True)
class ExplainedSession:
    entry: SessionEntry
    explanations: list[KeyExplanation]
    age_s: float


class SessionOps:
    def __init__(self, book: SessionBook, ops: ControlOps, max_batch_keys: int) -> None:
        self.book, self.ops, self.max_batch_keys = book, ops, max_batch_keys

    def note(self, namespace: str, session: str, keys: list[bytes], ended: bool) -> int | None:
        """SessionBook.note after the checks every request gets; None: nothing recorded."""
        check_session_id(session)
        self._registered(namespace)
        if len(keys) > self.max_batch_keys:
            raise BatchTooLargeError(f"{len(keys)} keys in one session note exceeds max_batch_keys="
                                     f"{self.max_batch_keys}: note the chain's head (keys[:max_batch_keys])")
        if keys:
            check_keys(keys, self.max_batch_keys)
        return self.book.note(namespace, session, keys, ended)

    def explain(self, session: str, namespace: str) -> list[ExplainedSession]:
        """Each of the session's entries the caller may see (only `namespace`'s when given), explained."""
        check_session_id(session)
        if namespace:
            self._registered(namespace)
        entries = [e for e in self.book.get(session, namespace) if self.ops.guard.owns(e.namespace)]
        if not entries:
            where = f" in namespace {namespace!r}" if namespace else ""
            raise UnknownSessionError(
                f"no session {session!r}{where} in the daemon's session book: a session is noted when a request "
                f"carrying kv_transfer_params {{'kvstore_session': {session!r}}} finishes (the vLLM connector "
                "notes it), or by Client.note_session; the book keeps the latest session_book_max, so an old one "
                "may be forgotten. `kvstore sessions` lists what it holds")
        return [ExplainedSession(e, self.ops.explain(e.namespace, e.keys), self.book.age_s(e)) for e in entries]

    def _registered(self, namespace: str) -> None:
        """A valid name of a registered namespace the caller owns, else the error an unknown namespace gets."""
        check_namespace_name(namespace)
        self.ops.guard.namespace(namespace)
        self.ops.engine.tokens_per_block(namespace)  # UnknownNamespaceError when not registered

    def listing(self, limit: int) -> tuple[list[tuple[SessionEntry, float]], int]:
        """(entries the caller may see, most recently noted first, at most `limit` (0: all), with their ages;
        how many it may see in all)."""
        visible = [e for e in self.book.entries() if self.ops.guard.owns(e.namespace)]
        shown = visible[:limit] if limit else visible
        return [(e, self.book.age_s(e)) for e in shown], len(visible)


def session_explanation(x: ExplainedSession) -> pb.SessionExplanation:
    e = x.entry
    return pb.SessionExplanation(session=e.session, namespace=e.namespace, keys=e.keys, age_s=x.age_s, ended=e.ended,
                                 explanations=[to_message(k, pb.KeyExplanation) for k in x.explanations])


def session_info(e: SessionEntry, age_s: float) -> pb.SessionInfo:
    return pb.SessionInfo(session=e.session, namespace=e.namespace, blocks=len(e.keys), age_s=age_s, ended=e.ended)
