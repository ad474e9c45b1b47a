"""KVStoreConnector under vLLM 0.33's real v1 Scheduler (CPU), with a real daemon and a fake model runner:
loads of stored blocks (after a prefix-cache reset, a RAM hit in one step, partial prefixes, grouped keys),
failed loads recomputed, KV events, and saving generated tokens. Pipeline stages:
test_vllm_scheduler_stages.py; load jobs, evicted and failed blocks, the failure policy and an unmappable arena:
test_vllm_scheduler_failures.py.

Block size 16; with blocks_per_key=1 one stored block = one vLLM block, so a 100-token prompt stores
6 blocks (96 tokens) and a repeat can load 96 (vLLM computes the last token itself: at most 99 usable).
"""

from __future__ import annotations

from typing import Any


from kvstore_connector.namespace import namespace_for
from kvstore.client import Client
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from .harness import SAMPLED, Harness
from .stored import PROMPT, daemon_keys


def test_repeat_after_reset_prefix_cache_loads_exactly_the_stored_blocks(daemon, model_dir) -> None:
    h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1})
    h.add("r1", PROMPT)
    h.run()
    assert h.tracked["r1"].scheduled_tokens == 101            # 100 prompt + 1 decode step
    assert len(daemon_keys(h, daemon.address)) == 6                  # full prompt blocks only (save="prompt")
    assert h.scheduler.reset_prefix_cache()
    r2 = h.add("r2", list(PROMPT))
    out = h.step()                                             # r2 is admitted, its load planned ...
    (job,) = out.kv_connector_metadata.plan.loads
    (blocks,) = job.block_ids  # one KV cache group
    assert len(job.keys) == 6 and len(blocks) == 6 and -1 not in blocks
    assert "r2" not in out.num_scheduled_tokens                # ... and it waits: asynchronous load
    assert r2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    h.run()
    assert (h.prefill["r2"].num_external_cached_tokens, h.prefill["r2"].num_local_cached_tokens) == (96, 0)
    assert h.tracked["r2"].scheduled_tokens == 4 + 1           # only the 4-token tail and one decode step
    assert h.kv_matches_tokens("r2", 101)                      # loaded blocks hold what a forward writes
    assert list(r2.output_token_ids) == [SAMPLED, SAMPLED]
    totals = h.worker.counters.totals
    assert (totals["loaded_blocks"], totals.get("load_failed_blocks", 0)) == (6, 0)
    assert h.sched_side.counters.totals["hit_tokens"] == 96
    h.close()


def test_a_ram_hit_is_loaded_and_computed_in_one_step(daemon, model_dir) -> None:
    """load_mode "auto" (the default) and a hit in RAM: vLLM schedules the request in the step that admits it
    (no WAITING_FOR_REMOTE_KVS), the worker loads before the forward, and the outcome is the async one's."""
    h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1, "load_mode": "auto"})
    h.add("r1", PROMPT)
    h.run()
    assert h.scheduler.reset_prefix_cache()
    r2 = h.add("r2", list(PROMPT))
    out = h.step()
    (job,) = out.kv_connector_metadata.plan.loads
    assert job.sync and len(job.keys) == 6
    assert out.num_scheduled_tokens["r2"] == 4                 # scheduled at once: only the 4-token tail
    assert r2.status == RequestStatus.RUNNING
    h.run()
    assert (h.prefill["r2"].num_external_cached_tokens, h.prefill["r2"].num_local_cached_tokens) == (96, 0)
    assert h.tracked["r2"].scheduled_tokens == 4 + 1
    assert h.kv_matches_tokens("r2", 101)
    assert list(r2.output_token_ids) == [SAMPLED, SAMPLED]
    first = h.load_jobs[0][0]                                  # r1 ran steps [0, first): r2 takes no more
    assert len(h.steps) - first == first
    totals = h.worker.counters.totals
    assert (totals["loaded_blocks"], totals.get("load_failed_blocks", 0)) == (6, 0)
    h.close()


def test_a_failed_sync_load_is_recomputed_by_vllm(daemon, model_dir) -> None:
    """A stored block deleted between the scheduler's lookup and the synchronous load: the worker reports the
    job's blocks as failed in that step's output, vLLM discards the step's token for r2 and recomputes the
    prompt (kv_load_failure_policy=recompute), and r2 ends with the right KV and the right tokens."""
    h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1, "load_mode": "sync"})
    h.add("r1", PROMPT)
    h.run()
    assert h.scheduler.reset_prefix_cache()
    keys = daemon_keys(h, daemon.address)

    def evict(out: Any) -> None:
        if out.kv_connector_metadata.plan.loads:
            with Client(daemon.address) as c:
                assert c.delete(namespace_for(h.sched_side.spec), keys[2:3]) == 1
    h.before_worker = evict
    r2 = h.add("r2", list(PROMPT))
    h.run()
    assert h.worker.counters.totals["load_failed_blocks"] == 6
    assert h.kv_matches_tokens("r2", 101) and list(r2.output_token_ids) == [SAMPLED, SAMPLED]
    assert h.finish_reasons["r2"] == FinishReason.LENGTH
    assert len(daemon_keys(h, daemon.address)) == 6                   # the deleted block was saved again
    h.close()


def test_the_connector_leaves_kv_events_to_the_daemon(daemon, model_dir) -> None:
    """vLLM's take_events gets nothing from the connector: the daemon publishes the store's blocks (kv_events,
    tests/vllm_sched/test_vllm_router_hashes.py), with vLLM's hashes and removals. This daemon publishes none, so
    the connector builds and sends no vLLM identities either."""
    h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1})
    seen: list = []
    take = h.sched_side.take_events
    h.sched_side.take_events = lambda: seen.extend(take()) or ()   # vLLM's scheduler drains them each step
    h.add("r1", PROMPT)
    h.run()
    assert seen == [] and len(daemon_keys(h, daemon.address)) == 6
    assert all(not j.origins for s in h.steps for j in s.kv_connector_metadata.plan.saves)
    assert h.worker.counters.totals.get("annotated_keys", 0) == 0
    h.close()


def test_vllm_prefix_cache_hit_is_not_loaded_again(daemon, model_dir) -> None:
    h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1})
    h.add("r1", PROMPT)
    h.run()
    h.add("r2", list(PROMPT))                             # no reset: vLLM's own cache has 96 tokens
    h.run()
    assert (h.prefill["r2"].num_external_cached_tokens, h.prefill["r2"].num_local_cached_tokens) == (0, 96)
    assert all(not s.kv_connector_metadata.plan.loads for s in h.steps)
    assert h.worker.counters.totals.get("loaded_blocks", 0) == 0
    h.close()


def test_partial_prefix_loads_the_shared_blocks_and_saves_the_rest(daemon, model_dir) -> None:
    h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1})
    h.add("r1", PROMPT)
    h.run()
    assert h.scheduler.reset_prefix_cache()
    other = PROMPT[:40] + [(5 * i) % 900 + 20 for i in range(40)]  # shares 2 full blocks (32 tokens)
    h.add("r3", other)
    h.run()
    assert h.prefill["r3"].num_external_cached_tokens == 32
    assert h.tracked["r3"].scheduled_tokens == 48 + 1
    assert h.kv_matches_tokens("r3", 81)
    assert len(daemon_keys(h, daemon.address)) == 6 + 3              # r3's blocks 2..4 are new
    h.close()


def test_load_failure_falls_back_to_recompute(daemon, model_dir) -> None:
    h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1})
    h.add("r1", PROMPT)
    h.run()
    assert h.scheduler.reset_prefix_cache()

    def evict_before_load(out) -> None:
        if out.kv_connector_metadata.plan.loads:
            ns = namespace_for(h.sched_side.spec)
            with Client(daemon.address) as c:
                assert c.delete(ns, daemon_keys(h, daemon.address)) == 6

    h.before_worker = evict_before_load
    r2 = h.add("r2", list(PROMPT))
    h.run()
    assert h.worker.counters.totals["load_failed_blocks"] == 6
    assert h.tracked["r2"].scheduled_tokens == 100 + 1         # recomputed in full
    assert h.kv_matches_tokens("r2", 101)
    assert list(r2.output_token_ids) == [SAMPLED, SAMPLED]
    h.close()


def test_grouped_keys_with_a_local_hit_inside_the_first_stored_block(daemon, model_dir) -> None:
    h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 4})   # 64 tokens per stored block
    prompt = [(13 * i + 1) % 1000 + 10 for i in range(200)]
    h.add("a", prompt)
    h.run()
    assert len(daemon_keys(h, daemon.address)) == 3                  # 192 tokens
    assert h.scheduler.reset_prefix_cache()
    h.add("b", prompt[:32] + [50 + i % 40 for i in range(30)])  # puts 2 blocks of `prompt` in vLLM's cache
    h.run()
    h.add("c", list(prompt))
    h.run()
    assert (h.prefill["c"].num_external_cached_tokens, h.prefill["c"].num_local_cached_tokens) == (160, 32)
    assert h.tracked["c"].scheduled_tokens == 8 + 1
    assert h.kv_matches_tokens("c", 201)
    h.close()


def test_save_all_stores_generated_tokens_whose_kv_exists(daemon, model_dir) -> None:
    """100 prompt + 28 generated tokens: the KV of the last sampled token is never computed, so 127 positions
    exist -> 7 full blocks with save="all" (6 with the default "prompt")."""
    h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1, "save": "all"})
    h.add("r1", PROMPT, max_tokens=28)
    h.run()
    assert h.tracked["r1"].scheduled_tokens == 127
    assert len(daemon_keys(h, daemon.address)) == 7
    assert h.worker.counters.totals["saved_blocks"] == 7
    h.close()
