"""Agent hints under vLLM 0.33's real v1 Scheduler (CPU) with a real daemon: `Request.kv_hints` (vLLM's own
KvHintsEnvelope) and "kvstore_hints" in kv_transfer_params (SamplingParams.extra_args, as the OpenAI server passes
them) reach the connector's scheduler side, run when the request finishes (kvstore_connector/hints.py), and the daemon's
counters show each action's outcome. Malformed hints are counted and change nothing vLLM computes.

blocks_per_key=1, block size 16: a 100-token prompt stores 6 blocks.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvstore_connector.namespace import namespace_for
from kvstore.client import Client
from vllm.sampling_params import SamplingParams
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
from vllm.v1.request import Request

from .harness import SAMPLED, Harness, Tracked
from .stored import PROMPT, chain_keys, daemon_keys




def add(h: Harness, rid: str, prompt: list[int], *, kv_hints: KvHintsEnvelope | None = None,
        params: dict[str, Any] | None = None, max_tokens: int = 2) -> Request:
    """Harness.add with the two ways a hint comes in."""
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                        extra_args={"kv_transfer_params": params} if params is not None else None)
    req = Request(rid, prompt, sp, None, block_hasher=h._hasher, kv_hints=kv_hints)
    h.scheduler.add_request(req)
    h.tracked[rid] = Tracked(req)
    return req


def envelope(*actions: tuple[str, dict[str, Any]], version: str = "1") -> KvHintsEnvelope:
    return KvHintsEnvelope("1", "msg-1", [KvHintAction(f"a{i}", kind, version, payload)
                                          for i, (kind, payload) in enumerate(actions)])


def hinted(way: str, hints: list[dict[str, Any]], session: str | None = None) -> dict[str, Any]:
    """`add`'s arguments carrying ``hints`` (each {"action": ..., other fields}) one way in: vLLM's envelope
    (the action as action_type, the rest as payload) or kv_transfer_params."""
    if way == "kv_hints":
        first = {"kvstore_session": session} if session is not None else {}
        return {"kv_hints": envelope(*((h["action"], {**(first if i == 0 else {}),
                                                       **{k: v for k, v in h.items() if k != "action"}})
                                       for i, h in enumerate(hints)))}
    return {"params": {"kvstore_hints": hints, **({"kvstore_session": session} if session is not None else {})}}


def hint_counts(h: Harness) -> dict[str, float]:
    sched = h.sched_side._sched
    assert sched is not None and sched.hints.flush(20.0), "the hint thread did not finish its queue in 20 s"
    return {k: v for k, v in h.sched_side.counters.totals.items() if k.startswith("hint_")}


def daemon_hints(address: str) -> dict[str, int]:
    with Client(address) as c:
        return {k: v for k, v in c.stats().counters.items() if k.startswith("hint_") and v}


WAYS = ["kv_hints", "kv_transfer_params"]


@pytest.mark.parametrize("way", WAYS)
def test_each_action(daemon, model_dir, way: str) -> None:
    """One request's hints: retain its own 6 blocks, pin 2 keys, prefetch a 48-token prefix (3 blocks), demote
    its session's chain (no disk tier: 6 rejected). vLLM's run is the plain one."""
    h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1})
    keys = chain_keys(6, PROMPT)
    r1 = add(h, "r1", PROMPT, **hinted(way, [
        {"action": "kvstore.retain" if way == "kv_hints" else "retain", "ttl_s": 30},
        {"action": "pin", "ttl_s": 30, "keys": [k.hex() for k in keys[:2]]},
        {"action": "prefetch", "tokens": PROMPT[:48]},
        {"action": "demote", "session": "s1"}], session="s1"))
    h.run()
    assert list(r1.output_token_ids) == [SAMPLED, SAMPLED] and h.tracked["r1"].scheduled_tokens == 101
    assert hint_counts(h) == {"hint_accepted": 6 + 2 + 3, "hint_rejected": 6}
    assert daemon_hints(daemon.address) == {"hint_retain_accepted": 6, "hint_pin_accepted": 2,
                                            "hint_prefetch_accepted": 3, "hint_demote_rejected": 6}
    assert h.sched_side._sched.hints.chain("s1") == tuple(keys)
    with Client(daemon.address) as c:
        assert c.stats().pinned_bytes == 2 * 32 * 1024  # 2 layers x K/V x 16 tokens x 2 heads x 64 x 4 bytes
    h.close()


@pytest.mark.parametrize("way", WAYS)
def test_release_of_a_forked_session(daemon, model_dir, way: str) -> None:
    """Sub-agents a and b share a 64-token head (4 blocks) and end in their own 2 blocks. A third request ends
    a: only a's 2 private blocks are released, the shared head stays (b lives)."""
    h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1})
    pa = PROMPT
    pb = PROMPT[:64] + [(5 * i + 1) % 1000 + 10 for i in range(36)]
    add(h, "a", pa, params={"kvstore_session": "a"})
    h.run()
    add(h, "b", pb, kv_hints=envelope(("retain", {"ttl_s": 5, "session": "b"})))  # b: its first session hint
    h.run()
    ka, kb = chain_keys(6, pa), chain_keys(6, pb)
    assert ka[:4] == kb[:4] and ka[4] != kb[4]
    sched = h.sched_side._sched
    assert sched.hints.chain("a") == tuple(ka) and sched.hints.chain("b") == tuple(kb)
    assert hint_counts(h) == {"hint_accepted": 6}  # b's retain
    add(h, "end", [1, 2, 3], max_tokens=1, **hinted(way, [{"action": "release", "session": "a"}]))
    h.run()
    assert hint_counts(h) == {"hint_accepted": 6 + 2}
    assert daemon_hints(daemon.address) == {"hint_retain_accepted": 6, "hint_release_accepted": 2}
    assert sched.hints.chain("a") == ()
    assert [sched.hints.refs([namespace_for(h.sched_side.spec)], k) for k in kb] == [1] * 6
    h.close()


def test_malformed_hints_are_counted_and_change_nothing(daemon, model_dir) -> None:
    """Five malformed hints over both ways in: counted; the run computes, samples and stores what a run without
    hints does."""
    h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1})
    r1 = add(h, "r1", PROMPT, kv_hints=envelope(("retain", {"ttl_s": 1}), version="2"),
             params={"kvstore_hints": [{"action": "keep"}, {"action": "pin"},
                                       {"action": "release", "keys": ["zz"]}], "kvstore_session": ""})
    h.run()
    assert hint_counts(h) == {"hint_malformed": 5}
    assert list(r1.output_token_ids) == [SAMPLED, SAMPLED] and h.tracked["r1"].scheduled_tokens == 101
    assert h.kv_matches_tokens("r1", 101)
    assert daemon_keys(h, daemon.address) == sorted(chain_keys(6, PROMPT))
    assert h.scheduler.reset_prefix_cache()
    r2 = add(h, "r2", list(PROMPT), kv_hints=envelope(("retain", "not an object")))  # type: ignore[arg-type]
    h.run()
    assert hint_counts(h) == {"hint_malformed": 6}
    assert (h.prefill["r2"].num_external_cached_tokens, h.tracked["r2"].scheduled_tokens) == (96, 5)
    assert list(r2.output_token_ids) == [SAMPLED, SAMPLED] and h.kv_matches_tokens("r2", 101)
    h.close()
