"""Agent hints through the connector (issue 15 item 1): kv_transfer_params' "kvstore_hints" and vLLM's
Request.kv_hints envelope, parsed into one form (kvstore_connector/hints.py), aimed at a session's chain, explicit keys, a
token prefix or the request's own blocks, and sent to a real daemon off the scheduler's thread. The CPU rig of
tests/connector_helpers.py; `hints.flush()` waits for the background thread."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kvstore_connector.hints import HINT_COUNTERS, Hint, HintError, HintSessions, parse_hint, request_hints
from kvstore_connector.keys import KeyChain, chain_root
from kvstore_connector.link import StoreLink
from kvstore_connector.namespace import namespace_for
from kvstore_connector.scheduler import SchedulerSide
from kvstore_connector.stats import COUNTER_NAMES, ConnectorCounters
from kvstore.client import Client, KeyExplanation
from kvstore.hint_vocab import HintAction
from kvstore.testing import wait_until
from kvstore.vocab import Tier
from tests.connector_helpers import T, Req, Side, make_caches, prompt_tokens



@dataclass
class HReq(Req):
    """A Req with the two ways a hint comes in."""

    kv_transfer_params: dict[str, Any] | None = None
    kv_hints: Any = None


@dataclass(frozen=True)
class Action:  # the shape of vllm.v1.kv_hints.KvHintAction (the vLLM test uses the real class)
    action_id: str
    action_type: str
    action_version: str
    payload: dict[str, Any]


@dataclass(frozen=True)
class Envelope:
    protocol_version: str
    message_id: str
    actions: list[Action] = field(default_factory=list)


def ns() -> str:
    from tests.connector_helpers import SPEC
    return namespace_for(SPEC)


def keys_of(prompt: list[int]) -> list[bytes]:
    return KeyChain(T, 0, chain_root(0)).extend(prompt)


def hint_counts(sched: SchedulerSide) -> dict[str, float]:
    assert sched.hints.flush(timeout_s=20.0), "the hint thread did not finish its queue in 20 s"
    return {k: v for k, v in sched.counters.totals.items() if k.startswith("hint_")}


def finish(s: Side, req: HReq, blocks: list[int]) -> None:
    """Prefill (saving every full block of the prompt), then vLLM's request_finished."""
    s.prefill(req, blocks)
    assert s.sched.request_finished(req) is False


# -- parsing ---------------------------------------------------------------------------------------------------
def test_counters_are_connector_counters() -> None:
    assert HINT_COUNTERS == ("hint_accepted", "hint_clipped", "hint_deferred", "hint_rejected", "hint_missing",
                             "hint_malformed", "hint_failed", "hint_dropped", "hint_empty", "session_noted",
                             "session_note_failed")
    assert set(HINT_COUNTERS) <= set(COUNTER_NAMES)


def test_each_form_parses_to_one_hint() -> None:
    k = "00112233445566778899aabbccddeeff"
    assert parse_hint({"action": "retain", "ttl_s": 30, "session": "s1"}) == Hint(HintAction.RETAIN, 30.0, "s1")
    assert parse_hint({"action": "RELEASE", "keys": [k]}) == Hint(HintAction.RELEASE, keys=(bytes.fromhex(k),))
    assert parse_hint({"action": "pin", "ttl_s": 1.5, "tokens": [1, 2]}) == Hint(HintAction.PIN, 1.5, tokens=(1, 2))
    assert parse_hint({"action": "prefetch"}) == Hint(HintAction.PREFETCH)
    req = HReq("r", [1], kv_transfer_params={"kvstore_session": "s9", "kvstore_hints": [{"action": "demote"}]},
               kv_hints=Envelope("1", "m", [Action("a1", "kvstore.retain", "1", {"ttl_s": 5, "session": "s2"}),
                                            Action("a2", "pin", "1", {"ttl_s": 2})]))
    assert request_hints(req) == ([Hint(HintAction.DEMOTE), Hint(HintAction.RETAIN, 5.0, "s2"),
                                   Hint(HintAction.PIN, 2.0)], "s9", [])
    # without kvstore_session, the first session a hint other than a release names
    only = HReq("r", [1], kv_hints=Envelope("1", "m", [Action("a", "release", "1", {"session": "s3"}),
                                                        Action("b", "retain", "1", {"session": "s4", "ttl_s": 1})]))
    assert request_hints(only)[1] == "s4"
    assert request_hints(HReq("r", [1])) == ([], None, [])


@pytest.mark.parametrize("obj, says", [
    ({"action": "keep"}, "unknown hint action 'keep'"),
    ({"action": "retain"}, "retain needs ttl_s > 0"),
    ({"action": "pin", "ttl_s": -1}, "ttl_s=-1"),
    ({"action": "retain", "ttl_s": True}, "ttl_s=True"),
    ({"action": "release", "sesion": "s1"}, "unknown hint field(s) ['sesion']"),
    ({"action": "release", "session": "s1", "keys": ["00" * 16]}, "one target"),
    ({"action": "release", "keys": ["abc"]}, "32 hex digits"),
    ({"action": "release", "keys": []}, "non-empty list"),
    ({"action": "release", "tokens": [1, "2"]}, "token ids"),
    ({"action": "release", "session": ""}, "non-empty string"),
    ("release", "a hint is an object"),
])
def test_malformed_hints_say_what_to_send(obj: Any, says: str) -> None:
    with pytest.raises(HintError) as err:
        parse_hint(obj)
    assert says in str(err.value)


def test_malformed_hints_are_counted_and_the_run_is_unchanged(daemon) -> None:
    """Seven malformed hints (params and envelope): counted, nothing sent; the request saves its 12 blocks."""
    s = Side(daemon.address, make_caches(401))
    bad = HReq("m1", prompt_tokens(100, start=701), kv_transfer_params={
        "kvstore_session": 7, "kvstore_hints": [{"action": "keep"}, {"action": "retain"}, "pin"]},
        kv_hints=Envelope("1", "m", [Action("a", "retain", "2", {"ttl_s": 1}), Action("b", "zap", "1", {}),
                                     Action("c", "retain", "1", {"action": "pin", "ttl_s": 1})]))
    finish(s, bad, list(range(25)))
    assert s.worker.counters.totals["saved_blocks"] == 12
    assert hint_counts(s.sched) == {"hint_malformed": 7}
    not_a_list = HReq("m2", prompt_tokens(20, start=702), kv_transfer_params={"kvstore_hints": {"action": "pin"}})
    finish(s, not_a_list, list(range(25, 30)))
    assert hint_counts(s.sched) == {"hint_malformed": 8}
    with Client(daemon.address) as c:
        assert c.exists(ns(), keys_of(bad.prompt_token_ids)) == [True] * 12
    s.close()


# -- sessions (no daemon: a store that is down fails each key sent, which counts exactly what was sent) ----------
def test_release_of_a_session_keeps_the_head_another_live_session_shares() -> None:
    """s1 and s2 fork after 5 shared blocks (12 blocks each): releasing s1 sends its 7 private keys and ends s1;
    releasing s2 then sends all 12 (no live session shares them any more). Each chain set and each session
    ended is one session note per shard namespace (all failed here: the store is down)."""
    counters = ConnectorCounters()
    link = StoreLink("/nonexistent/kvstore.sock", timeout_s=1.0)
    hints = HintSessions(link, counters, tokens_per_key=T, key_seed=0)
    head = prompt_tokens(40, start=703)
    a = HReq("a", head + prompt_tokens(60, start=704), kv_transfer_params={"kvstore_session": "s1"})
    b = HReq("b", head + prompt_tokens(60, start=705), kv_transfer_params={"kvstore_session": "s2"})
    ka, kb = keys_of(a.prompt_token_ids), keys_of(b.prompt_token_ids)
    assert ka[:5] == kb[:5] and ka[5] != kb[5]
    for r, keys in ((a, ka), (b, kb)):
        hints.finished(r, ["ns0"], keys, chain_root(0))
    assert hints.chain("s1") == tuple(ka) and hints.chain("s2") == tuple(kb)
    assert [hints.refs(["ns0"], k) for k in ka] == [2] * 5 + [1] * 7
    hints.finished(HReq("end1", [1], kv_transfer_params={"kvstore_hints": [{"action": "release", "session": "s1"}]}),
                   ["ns0"], [], chain_root(0))
    assert hints.flush(10.0) and counters.totals == {"hint_failed": 7, "session_note_failed": 2 + 1}
    assert hints.chain("s1") == () and [hints.refs(["ns0"], k) for k in kb] == [1] * 12
    hints.finished(HReq("end2", [1], kv_hints=Envelope("1", "m", [Action("x", "release", "1", {"session": "s2"})])),
                   ["ns0"], [], chain_root(0))
    assert hints.flush(10.0) and counters.totals == {"hint_failed": 19, "session_note_failed": 4}
    # an unknown session has no keys: counted empty, nothing sent; two shard namespaces: each key once per shard
    hints.finished(HReq("end3", [1], kv_transfer_params={"kvstore_session": "s5", "kvstore_hints": [
        {"action": "retain", "ttl_s": 1, "session": "gone"}, {"action": "prefetch"}]}),
        ["ns0", "ns1"], ka[:2], chain_root(0))
    assert hints.flush(10.0) and counters.totals == {"hint_failed": 19 + 2 * 2, "hint_empty": 1,
                                                     "session_note_failed": 4 + 2}
    assert hints.chain("s5") == tuple(ka[:2])
    hints.close()


def test_a_full_queue_drops_and_malformed_hints_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    counters = ConnectorCounters()
    hints = HintSessions(StoreLink("/nonexistent/kvstore.sock", timeout_s=1.0), counters, tokens_per_key=T,
                         key_seed=0, capacity=0)
    own = keys_of(prompt_tokens(16, start=710))
    with caplog.at_level("WARNING", logger="kvstore_connector.hints"):
        for i in range(3):
            hints.finished(HReq(f"q{i}", [1], kv_transfer_params={"kvstore_hints": [{"action": "prefetch"},
                                                                                     {"action": "pin"}]}),
                           ["ns0"], own, chain_root(0))
    assert hints.flush(10.0) and counters.totals == {"hint_dropped": 3, "hint_malformed": 3}
    malformed, dropped = (r.getMessage() for r in caplog.records)  # each once, not three times
    assert "request q0: dropped malformed hint(s): hint pin needs ttl_s > 0" in malformed
    assert "the hint queue is full (0); dropping hints" in dropped
    hints.close()


# -- each action through a real daemon ---------------------------------------------------------------------------
def test_each_action_through_kv_transfer_params(daemon) -> None:
    """12 stored blocks of one request: each action aimed at them (own blocks, keys, tokens, session)."""
    s = Side(daemon.address, make_caches(403))
    prompt = prompt_tokens(100, start=706)
    keys = keys_of(prompt)
    first = HReq("h1", prompt, kv_transfer_params={"kvstore_session": "agent", "kvstore_hints": [
        {"action": "retain", "ttl_s": 30},                                   # own 12 blocks
        {"action": "pin", "ttl_s": 30, "keys": [k.hex() for k in keys[:3]]},
        {"action": "prefetch", "tokens": prompt[:40]},                       # 5 full blocks
        {"action": "demote", "session": "agent"}]})                          # no disk tier: 12 rejected
    finish(s, first, list(range(25)))
    assert hint_counts(s.sched) == {"hint_accepted": 12 + 3 + 5, "hint_rejected": 12}
    with Client(daemon.address) as c:
        got = c.stats().counters
        assert {k: got[k] for k in ("hint_retain_accepted", "hint_pin_accepted", "hint_prefetch_accepted",
                                    "hint_demote_rejected")} == {"hint_retain_accepted": 12, "hint_pin_accepted": 3,
                                                                "hint_prefetch_accepted": 5,
                                                                "hint_demote_rejected": 12}
        assert c.exists(ns(), keys) == [True] * 12
    # keys the store never had answer missing
    s.sched.request_finished(HReq("h2", [1], kv_transfer_params={"kvstore_hints": [
        {"action": "release", "tokens": prompt_tokens(16, start=999)}]}))
    assert hint_counts(s.sched)["hint_missing"] == 2
    s.close()


def test_a_released_session_is_evicted_first_under_pressure(make_daemon) -> None:
    """B stored, then A (LRU would evict B first); A's session released: the next 12 evictions take A's 12
    blocks and B keeps all of its."""
    d = make_daemon(arena_bytes="4MiB", max_block_bytes="64KiB", high_watermark=1.0, low_watermark=1.0,
                    disk_bytes=0)
    s = Side(d.address, make_caches(404))
    b = HReq("b", prompt_tokens(100, start=707), kv_transfer_params={"kvstore_session": "sb"})
    a = HReq("a", prompt_tokens(100, start=708), kv_transfer_params={"kvstore_session": "sa"})
    finish(s, b, list(range(25)))
    finish(s, a, list(range(25, 50)))
    s.sched.request_finished(HReq("end", [1], kv_transfer_params={"kvstore_hints": [
        {"action": "release", "session": "sa"}]}))
    assert hint_counts(s.sched) == {"hint_accepted": 12}
    size = len(s.caches) * 2 * 2 * 4 * 2 * 8 * 2  # one stored block: layers x K/V x blocks x BS x heads x HD x 2
    with Client(d.address) as c:
        c.register_namespace("filler")
        n = 0
        while c.stats().counters["evictions"] < 12:
            c.put_many("filler", [b"f%d" % n], [b"x" * size])
            n += 1
        assert c.stats().counters["evictions"] == 12
        assert c.exists(ns(), keys_of(a.prompt_token_ids)) == [False] * 12
        assert c.exists(ns(), keys_of(b.prompt_token_ids)) == [True] * 12
    s.close()


def tiers(c: Client, keys: list[bytes]) -> list[str | None]:
    return [i.tier if i is not None else None for i in c.describe(ns(), keys)]


def test_demote_then_prefetch_a_session_moves_it_between_ram_and_disk(make_daemon) -> None:
    """With a disk tier under disk_write = commit: demote the session's 12 blocks (written behind already: RAM
    freed now), prefetch them back before the next turn, then a retain longer than the daemon's hint_max_ttl_s
    (600 s) is clipped. (Under evict a Demote writes then frees: tests/test_engine_disk_write.py.)"""
    d = make_daemon(arena_bytes="8MiB", max_block_bytes="1MiB", disk_bytes="16MiB", disk_segment_bytes="4MiB",
                    disk_sync="none", disk_write="commit")
    s = Side(d.address, make_caches(405))
    prompt = prompt_tokens(100, start=709)
    keys = keys_of(prompt)
    finish(s, HReq("t1", prompt, kv_transfer_params={"kvstore_session": "tool"}), list(range(25)))
    with Client(d.address) as c:
        wait_until(lambda: tiers(c, keys) == ["ram+disk"] * 12, what="12 blocks written behind")
        s.sched.request_finished(HReq("wait", [1], kv_hints=Envelope("1", "m", [
            Action("x", "demote", "1", {"session": "tool"})])))
        assert hint_counts(s.sched) == {"hint_accepted": 12}
        assert tiers(c, keys) == ["disk"] * 12
        s.sched.request_finished(HReq("back", [1], kv_transfer_params={"kvstore_hints": [
            {"action": "prefetch", "session": "tool"}]}))
        assert hint_counts(s.sched) == {"hint_accepted": 24}
        wait_until(lambda: tiers(c, keys) == ["ram+disk"] * 12, what="12 blocks promoted by the prefetch")
        s.sched.request_finished(HReq("again", [1], kv_transfer_params={"kvstore_hints": [
            {"action": "retain", "ttl_s": 3600, "session": "tool"}]}))
        assert hint_counts(s.sched) == {"hint_accepted": 24, "hint_clipped": 12}
        got = c.stats().counters
    assert {k: v for k, v in got.items() if k.startswith("hint_") and v} == {
        "hint_demote_accepted": 12, "hint_prefetch_accepted": 12, "hint_retain_clipped": 12}
    s.close()


# -- session notes: the daemon's session book (kvstore explain --session) ----------------------------------------
def note_counts(sched: SchedulerSide) -> dict[str, float]:
    assert sched.hints.flush(timeout_s=20.0), "the hint thread did not finish its queue in 20 s"
    return {k: v for k, v in sched.counters.totals.items() if k.startswith("session_")}


def test_session_notes_reach_the_daemon_and_explain_follows_the_session(make_daemon) -> None:
    """A request of session "na" with no hint at all: its 12 stored keys become the daemon's entry (all in RAM);
    a Release of "na" marks the entry ended (kept, same chain); under pressure the released blocks go first and
    the same entry then explains all 12 as evicted by lru. A session with no stored keys is never noted."""
    d = make_daemon(arena_bytes="4MiB", max_block_bytes="64KiB", high_watermark=1.0, low_watermark=1.0,
                    disk_bytes=0)
    s = Side(d.address, make_caches(406))
    a = HReq("n1", prompt_tokens(100, start=711), kv_transfer_params={"kvstore_session": "na"})
    keys = tuple(keys_of(a.prompt_token_ids))
    finish(s, a, list(range(25)))
    assert note_counts(s.sched) == {"session_noted": 1}
    with Client(d.address) as c:
        [e] = c.explain_session("na")
        assert (e.session, e.namespace, e.keys, e.ended) == ("na", ns(), keys, False)
        assert e.explanations == (KeyExplanation(Tier.RAM),) * 12
        s.sched.request_finished(HReq("empty", [1], kv_transfer_params={"kvstore_session": "nb"}))  # no block
        s.sched.request_finished(HReq("end", [1], kv_transfer_params={"kvstore_hints": [
            {"action": "release", "session": "na"}]}))
        assert note_counts(s.sched) == {"session_noted": 2}
        assert hint_counts(s.sched) == {"hint_accepted": 12}
        [e] = c.explain_session("na")
        assert (e.keys, e.ended, e.explanations) == (keys, True, (KeyExplanation(Tier.RAM),) * 12)
        assert [(i.session, i.blocks, i.ended) for i in c.sessions()[0]] == [("na", 12, True)]
        size = len(s.caches) * 2 * 2 * 4 * 2 * 8 * 2  # one stored block (see the released-session test)
        c.register_namespace("filler")
        n = 0
        while c.stats().counters["evictions"] < 12:
            c.put_many("filler", [b"f%d" % n], [b"x" * size])
            n += 1
        [e] = c.explain_session("na")
        assert [(x.tier, x.cause, x.policy) for x in e.explanations] == [(Tier.NONE, "evicted", "lru")] * 12
    s.close()
