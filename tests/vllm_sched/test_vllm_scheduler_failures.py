"""KVStoreConnector under vLLM 0.33's real v1 Scheduler when loads go wrong: a load admitted after failed
allocations gets its job and its lookup once, a partly evicted prefix reloads what is left and stores the hole
again, kv_load_failure_policy "fail" is turned into recompute (and a policy that cannot be changed is refused
with the fix), and no hits are offered when the arena cannot be mapped. Block size 16, blocks_per_key=1 (see
test_vllm_scheduler.py).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvstore_connector import vllm_connector
from kvstore_connector.link import StoreLink
from kvstore_connector.namespace import namespace_for
from kvstore.client import Client
from kvstore.errors import ConfigError
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from .harness import BLOCK, LAYERS, SAMPLED, Harness
from .stored import PROMPT, chain_keys, daemon_keys, expected_key_bytes


# -- every async load gets a job (issue 16 item 7) -----------------------------------------------------------
def test_a_load_admitted_after_failed_allocations_gets_its_job_and_its_lookup_once(daemon, model_dir) -> None:
    """The harness asserts at every step that each request in WAITING_FOR_REMOTE_KVS has a load job not yet
    reported (the scheduler side used to drop the job, leaving the request waiting forever, when the allocated blocks
    did not match its stored-block count). Here A's load does not fit while B runs: vLLM asks the connector
    again at each step; the lookup is remembered, and A's job, when it comes, starts after B's cached prefix."""
    h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1})
    prompt = [(13 * i + 1) % 1000 + 10 for i in range(200)]
    h.add("r1", prompt)
    h.run()
    assert h.scheduler.reset_prefix_cache()
    b = h.add("b", prompt[:32] + [20 + (7 * i) % 900 for i in range(1900)], max_tokens=4)   # 121 of 128 blocks
    while b.num_computed_tokens < 1932:
        h.step()
    a = h.add("a", list(prompt))
    h.step()
    h.step()
    assert a.status == RequestStatus.WAITING and a.num_computed_tokens == 0  # allocation failed twice
    h.run()
    assert [r for _, r in h.load_jobs] == ["b", "a"]
    assert (h.prefill["a"].num_external_cached_tokens, h.prefill["a"].num_local_cached_tokens) == (160, 32)
    (job,) = [j for s in h.steps for j in s.kv_connector_metadata.plan.loads if j.req_id == "a"]
    assert job.keys == chain_keys(12, prompt)[2:]
    assert h.tracked["a"].scheduled_tokens == 8 + 1
    assert h.kv_matches_tokens("a", 201)
    # r1 199 usable tokens -> 12 keys, b 1931 -> 120 keys, a 12 keys once (not once per failed attempt)
    assert h.sched_side.counters.totals["lookup_tokens"] == (12 + 120 + 12) * BLOCK
    h.close()


# -- blocks that failed to load are stored again (issue 16 item 6) -----------------------------------------
def test_a_partly_evicted_prefix_reloads_what_is_left_and_stores_the_hole_again(daemon, model_dir) -> None:
    h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1})
    h.add("r1", PROMPT)
    h.run()
    keys = chain_keys(6, PROMPT)
    assert h.scheduler.reset_prefix_cache()
    deleted: list[int] = []

    def evict_key_3_before_the_first_load(out) -> None:
        if out.kv_connector_metadata.plan.loads and not deleted:
            with Client(daemon.address) as c:
                deleted.append(c.delete(namespace_for(h.sched_side.spec), keys[3:4]))

    h.before_worker = evict_key_3_before_the_first_load
    r2 = h.add("r2", list(PROMPT))
    h.run()
    assert deleted == [1]
    # load of keys 0..5 fails (key 3 is gone) -> vLLM recomputes from block 0 and frees the blocks -> a new
    # lookup answers 3 keys -> they load -> 52 tokens computed -> keys 3..5 stored again
    loads = [j for s in h.steps for j in s.kv_connector_metadata.plan.loads]
    assert [(j.req_id, len(j.keys)) for j in loads] == [("r2", 6), ("r2", 3)]
    assert [r for _, r in h.load_jobs] == ["r2", "r2"]
    assert h.worker.counters.totals["load_failed_blocks"] == 6
    assert h.worker.counters.totals["loaded_blocks"] == 3
    assert h.tracked["r2"].scheduled_tokens == 52 + 1
    assert h.kv_matches_tokens("r2", 101)
    assert h.finish_reasons["r2"] == FinishReason.LENGTH and list(r2.output_token_ids) == [SAMPLED, SAMPLED]
    assert h.sched_side.counters.totals["save_keys"] == 6 + 3
    assert sorted(daemon_keys(h, daemon.address)) == sorted(keys)
    with Client(daemon.address) as c:
        assert c.get(namespace_for(h.sched_side.spec), keys[3]) == expected_key_bytes(PROMPT, 3, range(LAYERS))
    h.close()


# -- kv_load_failure_policy and stream mode (issue 16 item 4) ----------------------------------------------
@pytest.mark.parametrize("policy", [None, "fail"])
def test_fail_policy_is_turned_into_recompute_and_failed_blocks_are_saved_again(daemon, model_dir, policy,
                                                                                caplog) -> None:
    """vLLM defaults kv_load_failure_policy to "fail": a block evicted between lookup and load would end the
    request with an error. The connector makes it "recompute" before the Scheduler reads it; the blocks whose
    load failed are recomputed and stored again (before: stored_keys kept them as saved, a permanent hole)."""
    with caplog.at_level(logging.WARNING, logger="kvstore_connector.vllm_connector"):
        h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1}, policy=policy)
    assert h.vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"
    assert h.scheduler.recompute_kv_load_failures is True
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "kvstore_connector.vllm_connector"]
    assert f"kv_load_failure_policy was {policy or 'fail'!r}" in warning
    assert '"kv_load_failure_policy": "recompute"' in warning
    h.add("r1", PROMPT)
    h.run()
    keys = chain_keys(6, PROMPT)
    assert sorted(daemon_keys(h, daemon.address)) == sorted(keys)
    assert h.scheduler.reset_prefix_cache()

    def evict_before_load(out) -> None:
        if out.kv_connector_metadata.plan.loads:
            with Client(daemon.address) as c:
                assert c.delete(namespace_for(h.sched_side.spec), keys) == 6

    h.before_worker = evict_before_load
    r2 = h.add("r2", list(PROMPT))
    h.run()
    assert h.finish_reasons["r2"] == FinishReason.LENGTH              # finished normally, not ERROR
    assert list(r2.output_token_ids) == [SAMPLED, SAMPLED]
    assert h.worker.counters.totals["load_failed_blocks"] == 6
    assert h.tracked["r2"].scheduled_tokens == 100 + 1                # recomputed in full
    assert h.kv_matches_tokens("r2", 101)
    assert h.sched_side.counters.totals["load_rollback_keys"] == 6
    assert sorted(daemon_keys(h, daemon.address)) == sorted(keys)           # saved again, all six
    with Client(daemon.address) as c:
        stored = c.get_many(namespace_for(h.sched_side.spec), keys)
    assert stored == [expected_key_bytes(PROMPT, k, range(LAYERS)) for k in range(6)]
    h.close()


def test_policy_that_cannot_be_changed_is_refused_with_the_fix() -> None:
    """A config object that refuses the change (none of vLLM 0.32/0.33's do) stops startup with what to add."""
    from kvstore_connector.vllm_connector import _recompute_failed_loads

    class Frozen:
        @property
        def kv_load_failure_policy(self) -> str:
            return "fail"

    class Config:
        kv_transfer_config = Frozen()

    with pytest.raises(ConfigError) as e:
        _recompute_failed_loads(Config())
    assert "kv_load_failure_policy='recompute' (it is 'fail'" in str(e.value)
    assert 'add "kv_load_failure_policy": "recompute" to --kv-transfer-config' in str(e.value)


def test_no_hits_are_offered_when_the_arena_cannot_be_mapped(daemon, model_dir, monkeypatch, caplog) -> None:
    """A client in stream mode (daemon on another host, no access to its shared memory) cannot load: the
    scheduler offers nothing (before: it offered 96 tokens, every load failed and was recomputed)."""
    h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1})
    h.add("r1", PROMPT)
    h.run()
    h.close()
    assert len(daemon_keys(h, daemon.address)) == 6

    class StreamLink(StoreLink):
        def __init__(self, address: str, **kw: Any) -> None:
            super().__init__(address, client_factory=lambda: Client(address, mode="stream", timeout_s=kw["timeout_s"]),
                             **kw)

    monkeypatch.setattr(vllm_connector, "StoreLink", StreamLink)
    with caplog.at_level(logging.ERROR, logger="kvstore_connector.scheduler"):
        s = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1})
        s.add("r2", list(PROMPT))
        s.add("r3", list(PROMPT[:50]))
        s.run()
    assert s.sched_side.link.client.mode == "stream"
    assert (s.prefill["r2"].num_external_cached_tokens, s.prefill["r2"].num_local_cached_tokens) == (0, 0)
    assert all(not st.kv_connector_metadata.plan.loads for st in s.steps)
    assert s.tracked["r2"].scheduled_tokens == 101
    totals = s.sched_side.counters.totals
    assert totals["lookup_skipped_stream"] == 2                       # r2 and r3, one each
    assert (totals.get("load_requests", 0), totals.get("lookup_tokens", 0)) == (0, 0)
    assert s.worker.counters.totals.get("load_failed_blocks", 0) == 0
    msgs = [r.getMessage() for r in caplog.records if r.name == "kvstore_connector.scheduler"]
    assert len(msgs) == 1 and "its arena cannot be mapped by this process" in msgs[0]   # logged once
    s.close()
