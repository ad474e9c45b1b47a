"""KVStoreConnector under vLLM 0.33's real v1 Scheduler with pipeline parallelism: each stage stores its own
layers (the exact bytes a forward writes), hits are what every stage holds, and the stage specs follow vLLM's
layer split with one key size. Block size 16, blocks_per_key=1 (see test_vllm_scheduler.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable


from connector import vllm_connector
from connector.config import ConnectorConfig
from kvstore.client import Client
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig

from .harness import BLOCK, SAMPLED, Harness, write_model_config
from .stored import PROMPT, chain_keys, expected_key_bytes


# -- pipeline parallelism (issue 16 item 3) ----------------------------------------------------------------
def test_pipeline_stages_store_their_own_layers_and_hits_are_what_every_stage_holds(daemon, model_dir) -> None:
    """pipeline_parallel_size=2 under vLLM's real Scheduler, one worker per stage (layer 0 | layer 1). Each
    stage stores its own layer in its own namespace; with key 3 missing from stage 1 only, the scheduler offers
    3 keys (48 tokens), both stages load them, and stage 1's hole is stored again. (Before: both stages had one
    namespace, stage 1's saves were skipped as present, and its load scattered stage 0's layer into layer 1.)"""
    h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1}, pp=2)
    s0, s1 = h.sched_side.stages.specs
    assert (s0.layer_range, s1.layer_range) == ((0, 1), (1, 2))
    _hole_in_the_second_shard(h, daemon.address, lambda shard, k: expected_key_bytes(PROMPT, k, range(shard, shard + 1)))


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


# -- tensor parallelism (issue 18 item 3) ------------------------------------------------------------------
def test_tensor_parallel_ranks_store_their_own_heads_and_hits_are_what_every_rank_holds(daemon, model_dir) -> None:
    """tensor_parallel_size=2 under vLLM's real Scheduler, one worker per rank (one KV head each). Each rank
    stores its own heads in its own namespace; with key 3 missing from rank 1 only, the scheduler offers 3 keys
    (48 tokens), both ranks load them, and rank 1's hole is stored again. (Before: the scheduler asked rank 0's
    namespace only, offered 6 keys, and rank 1's load of key 3 failed, so vLLM recomputed from there.)"""
    h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1}, tp=2)
    r0, r1 = h.sched_side.stages.specs
    assert [(s.tp_rank, s.tp_size, s.num_kv_heads, s.layer_range) for s in (r0, r1)] == [(0, 2, 1, (0, 2)),
                                                                                      (1, 2, 1, (0, 2))]
    _hole_in_the_second_shard(h, daemon.address, lambda shard, k: expected_key_bytes(PROMPT, k, range(0, 2), shard, 2))


def _hole_in_the_second_shard(h: Harness, address: str, stored: Callable[[int, int], bytes]) -> None:
    """The scenario both shard kinds share (two shards, one worker each; `stored(shard, key)`: the bytes a
    forward makes that shard store for a key). The first request stores 6 keys in both shards' namespaces;
    with key 3 deleted from shard 1 only, the second request is offered 3 keys (48 tokens), both shards load
    them with no failure and hold what a forward writes, and only shard 1 stores key 3 again."""
    shards = list(h.sched_side.stages.specs)
    assert [w.spec for w in h.workers] == shards
    ns0, ns1 = h.sched_side.stages.names()
    assert ns0 != ns1
    h.add("r1", PROMPT)
    h.run()
    keys = chain_keys(6, PROMPT)
    with Client(address) as c:
        assert sorted(k.key for k in c.keys(ns0)) == sorted(k.key for k in c.keys(ns1)) == sorted(keys)
        assert c.get_many(ns0, keys) == [stored(0, k) for k in range(6)]
        assert c.get_many(ns1, keys) == [stored(1, k) for k in range(6)]
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
    assert h.kv_matches_tokens("r2", 101)                              # every shard holds what a forward writes
    assert list(r2.output_token_ids) == [SAMPLED, SAMPLED]
    assert [w.counters.totals["saved_blocks"] for w in h.workers] == [6, 6 + 1]   # r2: only shard 1 lacked key 3
    with Client(address) as c:
        assert sorted(k.key for k in c.keys(ns1)) == sorted(keys)
        assert c.get(ns1, keys[3]) == stored(1, 3)
    h.close()
