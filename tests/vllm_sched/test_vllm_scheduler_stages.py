"""KVStoreConnector under vLLM 0.33's real v1 Scheduler with pipeline parallelism: each stage stores its own
layers (the exact bytes a forward writes), hits are what every stage holds, and the stage specs follow vLLM's
layer split with one key size. Block size 16, blocks_per_key=1 (see test_vllm_scheduler.py).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from kvstore_connector import vllm_connector
from kvstore_connector.config import ConnectorConfig
from kvstore_connector.groups import groups_from_config
from kvstore_connector.namespace import namespace_for
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


# -- pipeline parallelism with hybrid KV cache groups (issue 18) --------------------------------------------
def _hybrid_pp_config(tmp_path, layers: int) -> VllmConfig:
    path = write_model_config(str(tmp_path))
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = layers
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    return VllmConfig(model_config=ModelConfig(model=path, skip_tokenizer_init=True, dtype="float32"),
                      cache_config=CacheConfig(block_size=BLOCK), device_config=DeviceConfig("cpu"),
                      parallel_config=ParallelConfig(pipeline_parallel_size=2))


def _projections(layer_names: list[str], full: list[int], stages: list[list[int]]) -> list[list[Any]]:
    """Each stage's share of a full + sliding-window model's KV cache groups, by vLLM's own projection."""
    import torch

    from vllm.v1.core.kv_cache_planning import _project_kv_cache_groups_to_worker
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

    fa = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32)
    sw = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=32)
    glob = [KVCacheGroupSpec([layer_names[i] for i in full], fa),
            KVCacheGroupSpec([n for i, n in enumerate(layer_names) if i not in full], sw)]
    return [_project_kv_cache_groups_to_worker(glob, {layer_names[i]: None for i in stage}) for stage in stages]


def test_hybrid_stage_names_agree_between_the_scheduler_and_every_worker(tmp_path) -> None:
    """Gemma-2-like (6 layers, odd ones full), PP 2: stage 0 holds 1 full and 2 sliding layers, stage 1 holds 2 and
    1. The scheduler has only stage 0's share of the groups, yet names stage 1's shards exactly as stage 1's worker
    does, and both resolve one blocks_per_key (before: the layer counts were in the digest, and stage 1 never hit)."""
    vc = _hybrid_pp_config(tmp_path, 6)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(6)]
    share = _projections(names, [1, 3, 5], [[0, 1, 2], [3, 4, 5]])
    assert [[len(g.layer_names) for g in s] for s in share] == [[1, 2], [2, 1]]
    cfg = ConnectorConfig.from_extra({"min_transfer_bytes": 65536})
    sched = vllm_connector.shard_specs(vc, cfg, groups_from_config(SimpleNamespace(kv_cache_groups=share[0])))
    for stage in (0, 1):
        wc = copy.deepcopy(vc)
        wc.parallel_config.rank = stage
        own = vllm_connector.stage_specs(wc, cfg, 0, groups_from_config(SimpleNamespace(kv_cache_groups=share[stage])))
        mine = own[vllm_connector._pp_rank(wc) * 2:][:2]
        assert [namespace_for(s) for s in mine] == [namespace_for(s) for s in sched[stage * 2:stage * 2 + 2]]
        assert {s.blocks_per_key for s in own} == {s.blocks_per_key for s in sched} == {2}  # 3 layers x 16 KiB
        assert [s.group_layers for s in mine] == [len(g.layer_names) for g in share[stage]]
    assert len({namespace_for(s) for s in sched}) == 4


def test_a_stage_without_layers_of_a_group_refuses_to_start(tmp_path) -> None:
    """4 layers, only layer 3 full, PP 2: stage 0 holds no full-attention layer, so no prefix could be loaded
    there; the worker refuses at startup and says how to avoid it."""
    import pytest

    from kvstore.errors import ConfigError
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig

    vc = _hybrid_pp_config(tmp_path, 4)
    vc.kv_transfer_config = KVTransferConfig(kv_connector="KVStoreConnector", kv_role="kv_both",
                                             kv_connector_module_path="kvstore_connector.vllm_connector",
                                             kv_connector_extra_config={"address": str(tmp_path / "none.sock")})
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    share = _projections(names, [3], [[0, 1], [2, 3]])
    assert [len(g.layer_names) for g in share[0]] == [0, 2]
    kcc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=share[0])
    with pytest.raises(ConfigError, match=r"stage 0 holds no layer of KV cache group\(s\) \[\(0, 'full'\)\].*"
                                          "VLLM_PP_LAYER_PARTITION"):
        vllm_connector.KVStoreConnector(vc, KVConnectorRole.WORKER, kcc)
