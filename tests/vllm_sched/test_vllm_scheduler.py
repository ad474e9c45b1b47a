"""KVStoreConnector under vLLM 0.33's real v1 Scheduler (CPU), with a real daemon and a fake model runner.

Block size 16; with blocks_per_key=1 one stored block = one vLLM block, so a 100-token prompt stores
6 blocks (96 tokens) and a repeat can load 96 (vLLM computes the last token itself: at most 99 usable).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import torch

from connector import vllm_connector
from connector.config import ConnectorConfig
from connector.keys import KeyChain, chain_root
from connector.link import StoreLink
from connector.namespace import namespace_for
from kvstore.client import Client
from kvstore.errors import ConfigError
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from .harness import BLOCK, HEAD_DIM, HEADS, LAYERS, SAMPLED, Harness, kv_value, write_model_config

PROMPT = [(11 * i + 3) % 1000 + 10 for i in range(100)]


def _keys(h: Harness, address: str) -> list[bytes]:
    with Client(address) as c:
        return [k.key for k in c.keys(namespace_for(h.sched_side.spec))]


def test_repeat_after_reset_prefix_cache_loads_exactly_the_stored_blocks(daemon, model_dir) -> None:
    h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1})
    h.add("r1", PROMPT)
    h.run()
    assert h.tracked["r1"].scheduled_tokens == 101            # 100 prompt + 1 decode step
    assert len(_keys(h, daemon.address)) == 6                  # full prompt blocks only (save="prompt")
    assert h.scheduler.reset_prefix_cache()
    r2 = h.add("r2", list(PROMPT))
    out = h.step()                                             # r2 is admitted, its load planned ...
    (job,) = out.kv_connector_metadata.plan.loads
    assert len(job.keys) == 6 and len(job.block_ids) == 6 and -1 not in job.block_ids
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
    keys = _keys(h, daemon.address)

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
    assert len(_keys(h, daemon.address)) == 6                   # the deleted block was saved again
    h.close()


def test_kv_events_name_the_stored_blocks(daemon, model_dir) -> None:
    from vllm.distributed.kv_events import BlockStored

    h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1})
    seen: list = []
    take = h.sched_side.take_events
    h.sched_side.take_events = lambda: seen.extend(take()) or ()   # vLLM's scheduler drains them each step
    h.add("r1", PROMPT)
    h.run()
    assert [type(e) for e in seen] == [BlockStored]
    (e,) = seen
    assert sorted(e.block_hashes) == sorted(_keys(h, daemon.address))  # the keys the daemon holds
    assert (len(e.block_hashes), e.parent_block_hash, e.token_ids, e.block_size) == (6, None, PROMPT[:96], 16)
    assert list(take()) == []
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
    assert len(_keys(h, daemon.address)) == 6 + 3              # r3's blocks 2..4 are new
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
                assert c.delete(ns, _keys(h, daemon.address)) == 6

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
    assert len(_keys(h, daemon.address)) == 3                  # 192 tokens
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
    assert len(_keys(h, daemon.address)) == 7
    assert h.worker.counters.totals["saved_blocks"] == 7
    h.close()


# -- stored bytes ------------------------------------------------------------------------------------------
def _expected_key_bytes(tokens: list[int], key: int, layers: range) -> bytes:
    """One stored block (blocks_per_key=1) as a forward writes it: per layer of the stage, K then V."""
    pos = torch.arange(key * BLOCK, (key + 1) * BLOCK)
    tok = torch.tensor(tokens[key * BLOCK:(key + 1) * BLOCK])
    return b"".join(kv_value(li, kv, pos, tok)[:, None, None].expand(-1, HEADS, HEAD_DIM).contiguous().numpy()
                    .tobytes() for li in layers for kv in range(2))


def _chain(n: int, prompt: list[int]) -> list[bytes]:
    return KeyChain(BLOCK, 0, chain_root(0)).extend(prompt)[:n]


# -- pipeline parallelism (issue 16 item 3) ----------------------------------------------------------------
def test_pipeline_stages_store_their_own_layers_and_hits_are_what_every_stage_holds(daemon, model_dir) -> None:
    """pipeline_parallel_size=2 under vLLM's real Scheduler, one worker per stage (layer 0 | layer 1). Each
    stage stores its own layer in its own namespace; with key 3 missing from stage 1 only, the scheduler offers
    3 keys (48 tokens), both stages load them, and stage 1's hole is stored again. (Before: both stages had one
    namespace, stage 1's saves were skipped as present, and its load scattered stage 0's layer into layer 1.)"""
    h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1}, pp=2)
    s0, s1 = h.sched_side.stages.specs
    assert (s0.layer_range, s1.layer_range) == ((0, 1), (1, 2))
    assert [w.spec for w in h.workers] == [s0, s1]
    ns0, ns1 = h.sched_side.stages.names()
    assert ns0 != ns1
    h.add("r1", PROMPT)
    h.run()
    keys = _chain(6, PROMPT)
    with Client(daemon.address) as c:
        assert sorted(k.key for k in c.keys(ns0)) == sorted(k.key for k in c.keys(ns1)) == sorted(keys)
        assert c.get_many(ns0, keys) == [_expected_key_bytes(PROMPT, k, range(0, 1)) for k in range(6)]
        assert c.get_many(ns1, keys) == [_expected_key_bytes(PROMPT, k, range(1, 2)) for k in range(6)]
        assert c.delete(ns1, keys[3:4]) == 1
    assert h.scheduler.reset_prefix_cache()
    r2 = h.add("r2", list(PROMPT))
    h.run()
    assert (h.prefill["r2"].num_external_cached_tokens, h.prefill["r2"].num_local_cached_tokens) == (48, 0)
    loads = [j for s in h.steps for j in s.kv_connector_metadata.plan.loads]
    assert [(j.req_id, j.keys) for j in loads] == [("r2", keys[:3])]
    assert [w.counters.totals["loaded_blocks"] for w in h.workers] == [3, 3]
    assert [w.counters.totals.get("load_failed_blocks", 0) for w in h.workers] == [0, 0]
    assert h.tracked["r2"].scheduled_tokens == 52 + 1
    assert h.kv_matches_tokens("r2", 101)                              # both layers hold what a forward writes
    assert list(r2.output_token_ids) == [SAMPLED, SAMPLED]
    assert [w.counters.totals["saved_blocks"] for w in h.workers] == [6, 6 + 1]   # r2: only stage 1 lacked key 3
    with Client(daemon.address) as c:
        assert sorted(k.key for k in c.keys(ns1)) == sorted(keys)
        assert c.get(ns1, keys[3]) == _expected_key_bytes(PROMPT, 3, range(1, 2))
    h.close()


def test_stage_specs_follow_vllms_layer_split_and_share_one_key_size(tmp_path) -> None:
    """3 layers over 2 stages: vLLM gives stage 0 layers 0-1 and stage 1 layer 2. Both stages store one key's
    tokens, so blocks_per_key comes from the smaller stage (16 KiB per vLLM block -> 4 for 64 KiB)."""
    path = write_model_config(str(tmp_path))
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = 3
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    vc = VllmConfig(model_config=ModelConfig(model=path, skip_tokenizer_init=True, dtype="float32"),
                    cache_config=CacheConfig(block_size=BLOCK), device_config=DeviceConfig("cpu"),
                    parallel_config=ParallelConfig(pipeline_parallel_size=2))
    specs = vllm_connector.stage_specs(vc, ConnectorConfig.from_extra({"min_transfer_bytes": 65536}), 0)
    assert [(s.layer_range, s.block_bytes, s.blocks_per_key) for s in specs] == [((0, 2), 32768, 4), ((2, 3), 16384, 4)]
    for rank, layers in ((0, (0, 2)), (1, (2, 3))):   # the stage each worker takes, as vLLM's model config does
        vc.parallel_config.rank = rank
        assert vc.model_config.get_layers_start_end_indices(vc.parallel_config) == layers
        assert specs[vllm_connector._pp_rank(vc)].layer_range == layers


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
    assert job.keys == _chain(12, prompt)[2:]
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
    keys = _chain(6, PROMPT)
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
    assert sorted(_keys(h, daemon.address)) == sorted(keys)
    with Client(daemon.address) as c:
        assert c.get(namespace_for(h.sched_side.spec), keys[3]) == _expected_key_bytes(PROMPT, 3, range(LAYERS))
    h.close()


# -- kv_load_failure_policy and stream mode (issue 16 item 4) ----------------------------------------------
@pytest.mark.parametrize("policy", [None, "fail"])
def test_fail_policy_is_turned_into_recompute_and_failed_blocks_are_saved_again(daemon, model_dir, policy,
                                                                                caplog) -> None:
    """vLLM defaults kv_load_failure_policy to "fail": a block evicted between lookup and load would end the
    request with an error. The connector makes it "recompute" before the Scheduler reads it; the blocks whose
    load failed are recomputed and stored again (before: stored_keys kept them as saved, a permanent hole)."""
    with caplog.at_level(logging.WARNING, logger="connector.vllm_connector"):
        h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1}, policy=policy)
    assert h.vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"
    assert h.scheduler.recompute_kv_load_failures is True
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "connector.vllm_connector"]
    assert f"kv_load_failure_policy was {policy or 'fail'!r}" in warning
    assert '"kv_load_failure_policy": "recompute"' in warning
    h.add("r1", PROMPT)
    h.run()
    keys = _chain(6, PROMPT)
    assert sorted(_keys(h, daemon.address)) == sorted(keys)
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
    assert sorted(_keys(h, daemon.address)) == sorted(keys)           # saved again, all six
    with Client(daemon.address) as c:
        stored = c.get_many(namespace_for(h.sched_side.spec), keys)
    assert stored == [_expected_key_bytes(PROMPT, k, range(LAYERS)) for k in range(6)]
    h.close()


def test_policy_that_cannot_be_changed_is_refused_with_the_fix() -> None:
    """A config object that refuses the change (none of vLLM 0.32/0.33's do) stops startup with what to add."""
    from connector.vllm_connector import _recompute_failed_loads

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
    assert len(_keys(h, daemon.address)) == 6

    class StreamLink(StoreLink):
        def __init__(self, address: str, **kw: Any) -> None:
            super().__init__(address, client_factory=lambda: Client(address, mode="stream", timeout_s=kw["timeout_s"]),
                             **kw)

    monkeypatch.setattr(vllm_connector, "StoreLink", StreamLink)
    with caplog.at_level(logging.ERROR, logger="connector.scheduler"):
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
    msgs = [r.getMessage() for r in caplog.records if r.name == "connector.scheduler"]
    assert len(msgs) == 1 and "its arena cannot be mapped by this process" in msgs[0]   # logged once
    s.close()
