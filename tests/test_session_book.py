"""The daemon's session book (kvstore/engine/sessions.py) on its own: entries per (session, namespace), the two
bounds (entries, keys) forgetting the least recently noted first, replacement, ended, and the config checks.
A test clock gives exact ages."""

from __future__ import annotations

import pytest

from kvstore.engine.sessions import SessionBook, SessionEntry, check_book_limits, check_session_id
from kvstore.errors import ConfigError, InvalidRequestError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def keys(tag: str, n: int) -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


def test_a_note_replaces_the_chain_and_an_end_keeps_it() -> None:
    clock = Clock()
    book = SessionBook(max_sessions=8, max_keys=100, clock=clock)
    assert book.note("ns0", "s1", keys("a", 3)) == 3
    clock.now = 101.5
    assert book.note("ns0", "s1", keys("b", 5)) == 5              # the latest request's chain replaces the first
    assert book.get("s1") == [SessionEntry("s1", "ns0", tuple(keys("b", 5)), 101.5, False)]
    assert (len(book), book.keys_held) == (1, 5)
    clock.now = 104.0
    assert book.note("ns0", "s1", [], ended=True) == 5            # ended: the chain noted before is kept
    [e] = book.get("s1")
    assert (e.keys, e.ended, e.noted, book.age_s(e)) == (tuple(keys("b", 5)), True, 104.0, 0.0)
    clock.now = 106.25
    assert book.age_s(e) == 2.25
    assert book.note("ns0", "s1", keys("c", 2)) == 2              # a new turn of the same id: live again
    assert [(e.keys, e.ended) for e in book.get("s1")] == [(tuple(keys("c", 2)), False)]
    # ending a session the book does not hold records nothing
    assert book.note("ns0", "ghost", [], ended=True) is None
    assert book.get("ghost") == [] and book.keys_held == 2
    with pytest.raises(InvalidRequestError, match="needs keys .* or ended=true"):
        book.note("ns0", "s1", [])


def test_one_entry_per_shard_namespace_most_recent_first() -> None:
    clock = Clock()
    book = SessionBook(max_sessions=8, max_keys=100, clock=clock)
    book.note("tp0", "s", keys("k", 4))
    clock.now += 1
    book.note("tp1", "s", keys("k", 4))
    book.note("tp0", "other", keys("o", 1))
    assert [(e.namespace, e.session) for e in book.get("s")] == [("tp1", "s"), ("tp0", "s")]
    assert [e.namespace for e in book.get("s", "tp0")] == ["tp0"]
    assert book.get("s", "tp9") == []
    assert [(e.session, e.namespace) for e in book.entries()] == [("other", "tp0"), ("s", "tp1"), ("s", "tp0")]


def test_the_entry_bound_forgets_the_least_recently_noted() -> None:
    book = SessionBook(max_sessions=3, max_keys=100)
    for s in ("s1", "s2", "s3"):
        book.note("ns", s, keys(s, 2))
    book.note("ns", "s1", keys("s1", 2))   # s1 noted again: now the newest, s2 the oldest
    book.note("ns", "s4", keys("s4", 2))   # 4 entries > 3: s2 goes
    assert [e.session for e in book.entries()] == ["s4", "s1", "s3"]
    assert (len(book), book.keys_held) == (3, 6)


def test_the_key_bound_forgets_old_sessions_and_cuts_a_long_chain_to_its_head() -> None:
    book = SessionBook(max_sessions=10, max_keys=10)
    book.note("ns", "a", keys("a", 4))
    book.note("ns", "b", keys("b", 4))
    assert book.note("ns", "c", keys("c", 4)) == 4      # 12 keys > 10: a (the oldest) goes
    assert [(e.session, len(e.keys)) for e in book.entries()] == [("c", 4), ("b", 4)]
    assert book.note("ns", "d", keys("d", 25)) == 10    # its first 10 keys; every other entry goes
    assert [(e.session, e.keys) for e in book.entries()] == [("d", tuple(keys("d", 10)))]
    assert book.keys_held == 10


def test_a_book_of_no_sessions_keeps_nothing() -> None:
    book = SessionBook(max_sessions=0, max_keys=1)
    assert book.note("ns", "s", [b"k"]) is None
    assert (len(book), book.entries(), book.get("s")) == (0, [], [])


@pytest.mark.parametrize("max_sessions, max_keys, says", [
    (-1, 10, "session_book_max=-1: use 0..1048576"),
    ((1 << 20) + 1, 10, "session_book_max=1048577: use 0..1048576"),
    (10, 0, "session_book_keys=0: use 1..16777216"),
])
def test_limits_are_checked_with_a_message_that_says_what_fits(max_sessions: int, max_keys: int, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        check_book_limits(max_sessions, max_keys)
    with pytest.raises(ConfigError, match=says):
        SessionBook(max_sessions, max_keys)


@pytest.mark.parametrize("session, says", [
    ("", "empty session: name the session"),
    ("x" * 257, "use 1..256 printable characters"),
    ("tab\there", "use 1..256 printable characters"),
])
def test_session_ids_are_checked(session: str, says: str) -> None:
    with pytest.raises(InvalidRequestError, match=says):
        check_session_id(session)
    check_session_id("x" * 256)
