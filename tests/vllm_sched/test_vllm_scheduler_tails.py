"""Partial last blocks (kvstore_connector/tails.py) under vLLM 0.33's real v1 Scheduler, a real daemon and the fake model
runner (harness.py): a request that runs to max_tokens saves its tail in its last step and vLLM frees its blocks
at once; one that stops sooner (a stop token, as on EOS) has vLLM hold its blocks for exactly the step in which
the workers gather its tail (every TP rank reports it; then a prefix-cache reset succeeds); an agent's next turn
is scheduled in one step with a hit that ends inside a block (or, loading asynchronously, waits one step for it),
and every loaded position holds what a forward writes; a resent prompt hits all but its last token.

Block size 16, one stored block per vLLM block; save "all" and load_mode "auto" (a hit in RAM loads in the
step that schedules it) unless a test says "async".
"""

from __future__ import annotations

import pytest

from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from .harness import SAMPLED, Harness
from .stored import PROMPT

TAILS = {"blocks_per_key": 1, "save": "all", "load_mode": "auto", "tails": True}


def _finish(h: Harness, rid: str, *, held: bool) -> None:
    """Run until `rid` finishes. A request that ran to max_tokens saved its tail in its last step: vLLM frees its
    blocks at once. One that stopped sooner (``held``): vLLM keeps them after that step and frees them after the
    next, in which every worker gathers the tail and reports the request sent."""
    while h.finish_reasons.get(rid) is None:
        h.step()
    if held:
        assert rid in h.scheduler.requests and h.scheduler.requests[rid].is_finished()  # held for the gather
        out = h.step()
        assert [(j.req_id, j.release) for j in out.kv_connector_metadata.plan.saves] == [(rid, True)]
    assert rid not in h.scheduler.requests                                            # freed
    assert h.scheduler.reset_prefix_cache()                                           # no block is still held


@pytest.mark.parametrize("mode", ["auto", "async"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("stop", [False, True], ids=["max_tokens", "stop_token"])
def test_an_agents_next_turn_loads_the_previous_turns_tail(daemon, model_dir, tp: int, stop: bool, mode: str) -> None:
    h = Harness(model_dir, daemon.address, extra={**TAILS, "load_mode": mode}, tp=tp)
    # 100 + 4 computed answer tokens: 6 full blocks + an 8-token tail (5 tokens, by max_tokens or a stop token)
    r1 = h.add("r1", PROMPT, max_tokens=9 if stop else 5, stop_after=5 if stop else None)
    _finish(h, "r1", held=stop)
    assert (len(r1.output_token_ids), h.finish_reasons["r1"]) == (5, FinishReason.STOP if stop else FinishReason.LENGTH)
    assert h.sched_side.counters.totals["tail_saves"] == 1
    assert sum(w.counters.totals["saved_blocks"] for w in h.workers) == 7 * tp  # 6 full + the tail, per rank
    turn = list(r1.all_token_ids) + [(5 * i + 1) % 900 + 20 for i in range(20)]   # 105 + 20 = 125 tokens
    r2 = h.add("r2", turn, max_tokens=2)
    out = h.step()
    (job,) = out.kv_connector_metadata.plan.loads
    assert len(job.keys) == 7 and job.sync is (mode == "auto")
    if mode == "auto":                              # in RAM: loaded and computed in this step
        assert out.num_scheduled_tokens["r2"] == 125 - 104 and r2.status == RequestStatus.RUNNING
    else:                                           # waits for its load, then computes from inside the block
        assert "r2" not in out.num_scheduled_tokens and r2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert r2.num_computed_tokens == 104
    h.run()
    assert (h.prefill["r2"].num_external_cached_tokens, h.prefill["r2"].num_local_cached_tokens) == (104, 0)
    assert h.tracked["r2"].scheduled_tokens == 21 + 1
    assert h.kv_matches_tokens("r2", 126)           # the loaded tail's 8 positions included, on every rank
    assert list(r2.output_token_ids) == [SAMPLED, SAMPLED]
    assert h.sched_side.counters.totals["tail_hit_tokens"] == 8
    h.close()


def test_a_resent_prompt_hits_all_but_its_last_token(daemon, model_dir) -> None:
    h = Harness(model_dir, daemon.address, extra={**TAILS, "save": "prompt"})
    h.add("r1", PROMPT)                             # 100 tokens: 6 full blocks + a 4-token tail, saved at once
    _finish(h, "r1", held=False)
    r2 = h.add("r2", list(PROMPT))
    h.run()
    assert (h.prefill["r2"].num_external_cached_tokens, h.prefill["r2"].num_local_cached_tokens) == (99, 0)
    assert h.tracked["r2"].scheduled_tokens == 1 + 1
    assert h.kv_matches_tokens("r2", 101)
    assert list(r2.output_token_ids) == [SAMPLED, SAMPLED]
    h.close()
