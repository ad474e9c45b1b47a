"""The session book: each agent session's latest chain of keys, so `kvstore explain --session S` can say, block
by block, where the session's cache lives now or why it is gone.

Only a client knows sessions (the vLLM connector: a request's ``kv_transfer_params["kvstore_session"]``), so it
notes them here (the NoteSession RPC): when a request of a session finishes, the keys it stored become the
session's chain, one entry per shard namespace; when the session is released, its entry is marked ended and
kept, since "why did my released session miss" is the question this answers. A note of a session that sends no
hint is recorded all the same.

    entry   (session, namespace) -> (chain of keys, last noted, ended)
    bound   at most ``max_sessions`` entries and ``max_keys`` keys over all entries; the least recently noted
            entry goes first (a new note of an entry makes it the newest). A chain longer than ``max_keys`` keeps
            its head (where a prefix Lookup's first miss is).
    memory  per key its bytes object (33 bytes + the key) and a tuple slot (8): ~57 bytes a 16-byte key, ~105 a
            64-byte one, so the default 262144 keys hold at most ~15-28 MiB; per entry ~400 bytes plus the
            session id, ~1.6 MiB for 4096 entries. ``max_sessions`` = 0 keeps nothing (every note is dropped).

The book is metadata about the store, never consulted by Lookup, eviction or hints. Thread-safe (its own lock:
the gRPC threads call it, never under the engine's lock).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.errors import ConfigError, InvalidRequestError

__all__ = ["SessionBook", "SessionEntry", "check_session_id", "check_book_limits",
           "MAX_SESSION_CHARS", "MAX_BOOK_SESSIONS", "MAX_BOOK_KEYS"]

MAX_SESSION_CHARS = 256
MAX_BOOK_SESSIONS = 1 << 20
MAX_BOOK_KEYS = 1 << 24


@dataclass(frozen=True)
class SessionEntry:
    session: str
    namespace: str
    keys: tuple[bytes, ...]
    noted: float   # the book's clock (monotonic seconds) at its last note
    ended: bool


def check_session_id(session: str) -> None:
    """1..MAX_SESSION_CHARS printable characters (it is echoed in tables and logs)."""
    if not isinstance(session, str) or not session:
        raise InvalidRequestError("empty session: name the session (the connector's kv_transfer_params "
                                  "'kvstore_session')")
    if len(session) > MAX_SESSION_CHARS or any(ord(ch) < 32 or ord(ch) == 127 for ch in session):
        raise InvalidRequestError(f"session {session[:40]!r}...: use 1..{MAX_SESSION_CHARS} printable characters "
                                  f"(got {len(session)})")


def check_book_limits(max_sessions: int, max_keys: int) -> None:
    """The daemon's settings session_book_max and session_book_keys; ConfigError says what fits."""
    if not 0 <= max_sessions <= MAX_BOOK_SESSIONS:
        raise ConfigError(f"invalid config: session_book_max={max_sessions}: use 0..{MAX_BOOK_SESSIONS} "
                          "(0 keeps no session book)")
    if not 1 <= max_keys <= MAX_BOOK_KEYS:
        raise ConfigError(f"invalid config: session_book_keys={max_keys}: use 1..{MAX_BOOK_KEYS}")


class SessionBook:
    """(session, namespace) -> its latest chain; bounded, least recently noted forgotten first."""

    def __init__(self, max_sessions: int = 4096, max_keys: int = 262144,
                 clock: Callable[[], float] = time.monotonic) -> None:
        check_book_limits(max_sessions, max_keys)
        self.max_sessions, self.max_keys = max_sessions, max_keys
        self.clock = clock  # tests pass their own to read exact ages
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str], SessionEntry] = OrderedDict()  # oldest note first
        self._keys = 0  # keys held over all entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def keys_held(self) -> int:
        return self._keys

    def note(self, namespace: str, session: str, keys: Sequence[bytes], ended: bool = False) -> int | None:
        """Record the session's chain in `namespace` (keys given) and/or that it ended. Returns the keys kept,
        or None when nothing was recorded: ended with no keys for an entry the book does not hold, or a book
        of max_sessions 0. No keys and not ended is a caller's bug (nothing to note): InvalidRequestError."""
        if not keys and not ended:
            raise InvalidRequestError("a session note needs keys (the chain of the session's latest request) "
                                      "or ended=true")
        with self._lock:
            if not self.max_sessions:
                return None
            at = (session, namespace)
            old = self._entries.pop(at, None)
            if old is not None:
                self._keys -= len(old.keys)
            if keys:
                chain = tuple(keys[:self.max_keys])
            elif old is not None:
                chain = old.keys
            else:
                return None
            self._entries[at] = SessionEntry(session, namespace, chain, self.clock(), ended)
            self._keys += len(chain)
            while len(self._entries) > self.max_sessions or self._keys > self.max_keys:
                _, gone = self._entries.popitem(last=False)
                self._keys -= len(gone.keys)
            return len(chain)

    def restore(self, entries: Sequence[tuple[str, str, Sequence[bytes], float, bool]]) -> int:
        """A predecessor's book, oldest note first, each (session, namespace, keys, age in seconds, ended): noted
        again with the same ages (a hand-over restart keeps `kvstore explain --session` answering). Entries
        whose session id breaks the rules are skipped; the bounds hold as for `note`. How many were kept."""
        now = self.clock()
        with self._lock:
            if not self.max_sessions:
                return 0
            for session, namespace, keys, age, ended in entries:
                try:
                    check_session_id(session)
                except InvalidRequestError:
                    continue
                old = self._entries.pop((session, namespace), None)
                if old is not None:
                    self._keys -= len(old.keys)
                chain = tuple(keys[:self.max_keys])
                self._entries[(session, namespace)] = SessionEntry(session, namespace, chain, now - age, ended)
                self._keys += len(chain)
            while len(self._entries) > self.max_sessions or self._keys > self.max_keys:
                _, gone = self._entries.popitem(last=False)
                self._keys -= len(gone.keys)
            return len(self._entries)

    def get(self, session: str, namespace: str = "") -> list[SessionEntry]:
        """The session's entries (only `namespace`'s when given), most recently noted first; [] if none."""
        with self._lock:
            if namespace:
                e = self._entries.get((session, namespace))
                return [e] if e is not None else []
            return [e for e in reversed(self._entries.values()) if e.session == session]

    def entries(self) -> list[SessionEntry]:
        """Every entry, most recently noted first."""
        with self._lock:
            return list(reversed(self._entries.values()))

    def age_s(self, entry: SessionEntry) -> float:
        return max(0.0, self.clock() - entry.noted)
