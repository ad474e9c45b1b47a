"""KVStoreConnector under vLLM 0.33's real v1 Scheduler with a hybrid KV cache and the hybrid manager on (issue 18):
full + sliding-window (window 48 tokens) and full + chunked local attention (chunks of 64), a real daemon and a fake
model runner (tests/vllm_sched/hybrid_harness.py). Exact keys saved per group (window trimming, checkpoints,
window_save "all"), exact hits and load jobs per group, partial hits where one group lacks a block, and a load
that fails in one group.

Block size 16, blocks_per_key=1: one key = one vLLM block. A 200-token prompt has 12 full keys (192 tokens);
vLLM computes the last prompt token itself, so a repeat can hit at most 192 tokens.
Expected sets below come from vLLM's own rule (hybrid_harness.skipped_tokens): at a prefix of P tokens a local
group keeps the blocks from skipped_tokens(P) // 16 on (sliding: P - 48 + 1; chunked: P // 64 * 64).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvstore_connector.groups import GroupKind
from kvstore_connector.namespace import namespace_for
from kvstore.client import Client
from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from .harness import BLOCK, SAMPLED

# the hybrid harness allocates the KV cache as vLLM 0.33 does (its planner and overlaid per-layer views)
pytest.importorskip("vllm.v1.core.kv_cache_planning", reason="vLLM 0.33's KV cache planner: run with .venv-vllm")

from .hybrid_harness import CHUNK, WINDOW, HybridHarness, skipped_tokens, write_hybrid_model_config  # noqa: E402
from .stored import chain_keys  # noqa: E402

PROMPT = [(13 * i + 1) % 1000 + 10 for i in range(200)]
KEYS = 12  # full stored blocks of PROMPT


@pytest.fixture(scope="module")
def sliding_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_hybrid_model_config(str(tmp_path_factory.mktemp("gemma3like")), "sliding")


@pytest.fixture(scope="module")
def chunked_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_hybrid_model_config(str(tmp_path_factory.mktemp("llama4like")), "chunked")


def namespaces(h: HybridHarness) -> list[str]:
    """The daemon namespace of each KV cache group, in group order."""
    specs = sorted(h.sched_side.stages.specs, key=lambda s: s.group_index)
    assert [s.group_index for s in specs] == [0, 1]
    return [namespace_for(s) for s in specs]


def stored(h: HybridHarness, address: str, prompt: list[int] = PROMPT) -> list[set[int]]:
    """Per group, the indices (in ``prompt``'s key chain) of the keys the daemon holds; a key of no chain fails."""
    chain = chain_keys(len(prompt) // BLOCK, prompt)
    with Client(address) as c:
        held = [[k.key for k in c.keys(ns)] for ns in namespaces(h)]
    assert all(k in chain for keys in held for k in keys)
    return [{chain.index(k) for k in keys} for keys in held]


def window_keys(local: str, points: list[int]) -> set[int]:
    """Keys a local group needs for hits at the prefixes ``points`` (tokens): vLLM's blocks kept there."""
    return {k for p in points for k in range(skipped_tokens(local, p) // BLOCK, p // BLOCK)}


def delete(h: HybridHarness, address: str, group: int, keys: list[int], prompt: list[int] = PROMPT) -> None:
    chain = chain_keys(len(prompt) // BLOCK, prompt)
    with Client(address) as c:
        assert c.delete(namespaces(h)[group], [chain[k] for k in keys]) == len(keys)


def save_and_reset(h: HybridHarness, prompt: list[int] = PROMPT) -> None:
    h.add("r1", prompt)
    h.run()
    assert h.scheduler.reset_prefix_cache()


def the_load(h: HybridHarness, rid: str) -> Any:
    (job,) = [j for s in h.steps for j in s.kv_connector_metadata.plan.loads if j.req_id == rid]
    return job


# -- the hybrid manager stays on ------------------------------------------------------------------------------
def test_the_hybrid_manager_stays_on_and_vllm_calls_request_finished_all_groups(daemon, sliding_dir) -> None:
    h = HybridHarness(sliding_dir, daemon.address, extra={"blocks_per_key": 1})
    assert h.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False  # vLLM kept HMA on
    assert h.coordinator_name == "HybridKVCacheCoordinator"
    assert isinstance(h.sched_side, SupportsHMA)
    assert [(g.layer_names, type(g.kv_cache_spec).__name__) for g in h.kv_cache_config.kv_cache_groups] == [
        (["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"], "FullAttentionSpec"),
        (["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"], "SlidingWindowSpec")]
    # vLLM's overlay: layer 0 (full) and layer 1 (sliding) are views of the same bytes, as are 2 and 3
    caches = h.kv_caches
    assert caches["model.layers.0.self_attn.attn"].data_ptr() == caches["model.layers.1.self_attn.attn"].data_ptr()
    assert caches["model.layers.2.self_attn.attn"].data_ptr() == caches["model.layers.3.self_attn.attn"].data_ptr()
    specs = sorted(h.sched_side.stages.specs, key=lambda s: s.group_index)
    assert [(s.group_kind, s.group_count, s.group_layers) for s in specs] == [
        (GroupKind("full"), 2, 2), (GroupKind("sliding", WINDOW), 2, 2)]
    assert len(set(namespaces(h))) == 2
    calls: list[tuple[str, str, int]] = []
    for name in ("request_finished", "request_finished_all_groups"):
        real = getattr(h.sched_side, name)

        def spy(request: Any, block_ids: Any, _real: Any = real, _name: str = name) -> Any:
            calls.append((_name, request.request_id, len(block_ids) if _name.endswith("groups") else -1))
            return _real(request, block_ids)
        setattr(h.sched_side, name, spy)
    h.add("r1", PROMPT)
    h.run()
    assert calls == [("request_finished_all_groups", "r1", 2)]
    assert h.finish_reasons["r1"] == FinishReason.LENGTH
    # vLLM kept all 13 full blocks and, at the last step (200 tokens computed), the sliding blocks from 153 // 16
    assert h.kept_match("r1", 201) == [list(range(13)), list(range(9, 13))]
    h.close()


# -- saves per group -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, sliding_keys", [
    ({}, window_keys("sliding", [192])),                                     # the window before the prompt end
    ({"window_checkpoint_tokens": 64}, window_keys("sliding", [64, 128, 192])),  # and before 64 and 128
    ({"window_save": "all"}, set(range(KEYS))),
])
def test_saved_keys_per_group(daemon, sliding_dir, extra, sliding_keys) -> None:
    h = HybridHarness(sliding_dir, daemon.address, extra={"blocks_per_key": 1, **extra})
    h.add("r1", PROMPT)
    h.run()
    assert stored(h, daemon.address) == [set(range(KEYS)), sliding_keys]
    chain = chain_keys(KEYS, PROMPT)
    with Client(daemon.address) as c:   # the exact bytes of one block of each group
        ns = namespaces(h)
        assert c.get(ns[0], chain[4]) == h.key_bytes(PROMPT, 4, 0)
        assert c.get(ns[1], chain[11]) == h.key_bytes(PROMPT, 11, 1)
        assert h.key_bytes(PROMPT, 11, 0) != h.key_bytes(PROMPT, 11, 1)
    assert h.worker.counters.totals["saved_blocks"] == KEYS + len(sliding_keys)
    h.close()


# -- loads per group -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [{}, {"window_save": "all"}])
def test_a_repeat_after_reset_loads_every_full_block_and_the_sliding_window(daemon, sliding_dir, extra) -> None:
    """With every sliding block stored ("all") the load still fills only the 3 blocks vLLM keeps at 192 tokens."""
    h = HybridHarness(sliding_dir, daemon.address, extra={"blocks_per_key": 1, **extra})
    save_and_reset(h)
    before = stored(h, daemon.address)
    r2 = h.add("r2", list(PROMPT))
    h.step()
    assert r2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    job = the_load(h, "r2")
    tables = h.vllm_blocks("r2")
    first = skipped_tokens("sliding", 192) // BLOCK                  # 9: blocks 9, 10, 11 are in the window
    assert job.keys == chain_keys(KEYS, PROMPT)
    assert tables[1][:first] == [0] * first and 0 not in tables[1][first:KEYS] and 0 not in tables[0]
    assert job.block_ids == [tables[0][:KEYS], [-1] * first + tables[1][first:KEYS]]
    h.run()
    assert (h.prefill["r2"].num_external_cached_tokens, h.prefill["r2"].num_local_cached_tokens) == (192, 0)
    assert h.tracked["r2"].scheduled_tokens == 8 + 1
    assert h.kept_match("r2", 201) == [list(range(13)), list(range(9, 13))]  # loaded blocks 9..11 included
    assert list(r2.output_token_ids) == [SAMPLED, SAMPLED]
    totals = h.worker.counters.totals
    assert (totals["loaded_blocks"], totals.get("load_failed_blocks", 0)) == (KEYS + 3, 0)
    assert stored(h, daemon.address) == before
    h.close()


# -- partial hits: one group lacks a block -----------------------------------------------------------------------
@pytest.mark.parametrize("extra, group, hole, hit", [
    # the window at 192 needs sliding keys 9..11; at 160 keys 7..9; at 128 keys 5..7 (skipped_tokens // 16)
    ({}, 1, 10, 0),                                     # only 9..11 stored: no shorter prefix has its window
    ({"window_save": "all"}, 1, 10, 160),               # 10 keys: window 7..9
    ({"window_checkpoint_tokens": 64}, 1, 10, 128),     # stored 1..3, 5..7, 9..11: 8 keys, window 5..7
    # the full group's prefix ends at key 5 (80 tokens): the window there is keys 2..4
    ({}, 0, 5, 0),
    ({"window_save": "all"}, 0, 5, 80),
    ({"window_checkpoint_tokens": 64}, 0, 5, 64),       # 4 keys: window 1..3
])
def test_a_group_missing_a_block_shortens_the_hit(daemon, sliding_dir, extra, group, hole, hit) -> None:
    h = HybridHarness(sliding_dir, daemon.address, extra={"blocks_per_key": 1, **extra})
    save_and_reset(h)
    before = stored(h, daemon.address)
    delete(h, daemon.address, group, [hole])
    held = stored(h, daemon.address)
    # the longest prefix whose full keys and sliding window are all held (vLLM's rule, independent of the connector)
    assert hit == max(n * BLOCK for n in range(KEYS + 1)
                      if set(range(n)) <= held[0] and window_keys("sliding", [n * BLOCK]) <= held[1])
    r2 = h.add("r2", list(PROMPT))
    h.run()
    assert (h.prefill["r2"].num_external_cached_tokens, h.prefill["r2"].num_local_cached_tokens) == (hit, 0)
    assert h.tracked["r2"].scheduled_tokens == 200 - hit + 1
    loads = [j for s in h.steps for j in s.kv_connector_metadata.plan.loads]
    if hit:
        (job,) = loads
        first = skipped_tokens("sliding", hit) // BLOCK
        assert job.keys == chain_keys(KEYS, PROMPT)[:hit // BLOCK]
        assert job.block_ids[1][:first] == [-1] * first and -1 not in job.block_ids[1][first:]
        assert h.worker.counters.totals["loaded_blocks"] == hit // BLOCK + hit // BLOCK - first
    else:
        assert loads == [] and h.worker.counters.totals.get("loaded_blocks", 0) == 0
    assert h.kept_match("r2", 201) == [list(range(13)), list(range(9, 13))]
    assert list(r2.output_token_ids) == [SAMPLED, SAMPLED]
    assert stored(h, daemon.address) == before                   # the hole was saved again
    h.close()


# -- full + chunked local attention ------------------------------------------------------------------------------
CPROMPT = [(7 * i + 5) % 1000 + 10 for i in range(230)]   # 14 keys (224 tokens); a repeat hits at most 224
CKEYS = 14


@pytest.mark.parametrize("extra, chunk_keys", [
    ({}, window_keys("chunked", [224])),                     # chunk 192..255: keys 12, 13
    ({"window_checkpoint_tokens": 64}, window_keys("chunked", [64, 128, 192, 224])),  # a hit at a chunk start
    ({"window_save": "all"}, set(range(CKEYS))),                                      # needs no chunked key
])
def test_chunked_local_saves_the_current_chunk_and_a_repeat_loads_it(daemon, chunked_dir, extra, chunk_keys) -> None:
    h = HybridHarness(chunked_dir, daemon.address, local="chunked", extra={"blocks_per_key": 1, **extra})
    assert h.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert h.coordinator_name == "HybridKVCacheCoordinator"
    assert [type(g.kv_cache_spec).__name__ for g in h.kv_cache_config.kv_cache_groups] == [
        "FullAttentionSpec", "ChunkedLocalAttentionSpec"]
    specs = sorted(h.sched_side.stages.specs, key=lambda s: s.group_index)
    assert [s.group_kind for s in specs] == [GroupKind("full"), GroupKind("chunked", CHUNK)]
    save_and_reset(h, CPROMPT)
    assert stored(h, daemon.address, CPROMPT) == [set(range(CKEYS)), chunk_keys]
    assert (window_keys("chunked", [224]), window_keys("chunked", [64, 128, 192])) == ({12, 13}, set())
    r2 = h.add("r2", list(CPROMPT))
    h.step()
    job = the_load(h, "r2")
    tables = h.vllm_blocks("r2")
    first = skipped_tokens("chunked", 224) // BLOCK                  # 12: the chunk starting at 192
    assert tables[1][:first] == [0] * first and 0 not in tables[1][first:CKEYS]
    assert job.block_ids == [tables[0][:CKEYS], [-1] * first + tables[1][first:CKEYS]]
    h.run()
    assert (h.prefill["r2"].num_external_cached_tokens, h.prefill["r2"].num_local_cached_tokens) == (224, 0)
    assert h.tracked["r2"].scheduled_tokens == 6 + 1
    assert h.kept_match("r2", 231) == [list(range(15)), list(range(12, 15))]
    assert list(r2.output_token_ids) == [SAMPLED, SAMPLED]
    assert h.worker.counters.totals["loaded_blocks"] == CKEYS + 2
    with Client(daemon.address) as c:
        assert c.get(namespaces(h)[1], chain_keys(CKEYS, CPROMPT)[13]) == h.key_bytes(CPROMPT, 13, 1)
    h.close()


@pytest.mark.parametrize("hole, hit", [(13, 208), (12, 192)])
def test_chunked_local_missing_a_block_of_the_chunk_shortens_the_hit(daemon, chunked_dir, hole, hit) -> None:
    """Key 13 gone: 13 keys (208 tokens) need only chunked key 12. Key 12 gone: 13 and 14 keys need it; 12 keys
    (192 tokens, a chunk start) need no chunked key at all."""
    h = HybridHarness(chunked_dir, daemon.address, local="chunked", extra={"blocks_per_key": 1})
    save_and_reset(h, CPROMPT)
    before = stored(h, daemon.address, CPROMPT)
    delete(h, daemon.address, 1, [hole], CPROMPT)
    held = stored(h, daemon.address, CPROMPT)
    assert hit == max(n * BLOCK for n in range(CKEYS + 1)
                      if set(range(n)) <= held[0] and window_keys("chunked", [n * BLOCK]) <= held[1])
    r2 = h.add("r2", list(CPROMPT))
    h.run()
    assert (h.prefill["r2"].num_external_cached_tokens, h.prefill["r2"].num_local_cached_tokens) == (hit, 0)
    assert h.tracked["r2"].scheduled_tokens == 230 - hit + 1
    (job,) = [j for s in h.steps for j in s.kv_connector_metadata.plan.loads]
    first = skipped_tokens("chunked", hit) // BLOCK                  # 12 for both
    assert len(job.keys) == hit // BLOCK and job.block_ids[1] == [-1] * first + job.block_ids[1][first:]
    assert -1 not in job.block_ids[1][first:] and len(job.block_ids[1]) == hit // BLOCK
    assert h.worker.counters.totals["loaded_blocks"] == hit // BLOCK + hit // BLOCK - first
    assert h.kept_match("r2", 231) == [list(range(15)), list(range(12, 15))]
    assert list(r2.output_token_ids) == [SAMPLED, SAMPLED]
    assert stored(h, daemon.address, CPROMPT) == before
    h.close()


# -- a load that fails in one group ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["async", "auto"])    # auto: a RAM hit, which the connector may load in-step
@pytest.mark.parametrize("extra, reload_keys", [({}, 0), ({"window_save": "all"}, 10)])
def test_a_sliding_block_deleted_before_the_load_is_recomputed(daemon, sliding_dir, extra, reload_keys,
                                                                 mode) -> None:
    """Sliding key 10 deleted between the lookup (192 tokens) and the load: the sliding group's part fails and vLLM
    recomputes; the next lookup finds the longest prefix whose window is whole (none with the trimmed window, 10
    keys when every sliding key is stored), and key 10 is saved again. With several KV cache groups vLLM 0.33
    takes a failed load only as a failed receive of the request (KVConnectorTransferResults.failed_recving): block
    ids repeat across groups, and a reported block id (get_block_ids_with_load_errors) raises in the Scheduler."""
    h = HybridHarness(sliding_dir, daemon.address, extra={"blocks_per_key": 1, "load_mode": mode, **extra})
    save_and_reset(h)
    before = stored(h, daemon.address)
    deleted: list[bool] = []

    def evict(out: Any) -> None:
        if out.kv_connector_metadata.plan.loads and not deleted:
            delete(h, daemon.address, 1, [10])
            deleted.append(True)
    h.before_worker = evict
    r2 = h.add("r2", list(PROMPT))
    h.run()
    assert deleted == [True]
    loads = [(j.req_id, len(j.keys)) for s in h.steps for j in s.kv_connector_metadata.plan.loads]
    assert loads == [("r2", KEYS)] + ([("r2", reload_keys)] if reload_keys else [])
    totals = h.worker.counters.totals
    first = skipped_tokens("sliding", reload_keys * BLOCK) // BLOCK
    assert totals.get("loaded_blocks", 0) == (reload_keys + reload_keys - first if reload_keys else 0)
    assert h.tracked["r2"].scheduled_tokens == 200 - reload_keys * BLOCK + 1
    assert h.kept_match("r2", 201) == [list(range(13)), list(range(9, 13))]
    assert h.finish_reasons["r2"] == FinishReason.LENGTH and list(r2.output_token_ids) == [SAMPLED, SAMPLED]
    assert stored(h, daemon.address) == before                   # key 10 saved again
    with Client(daemon.address) as c:
        assert c.get(namespaces(h)[1], chain_keys(KEYS, PROMPT)[10]) == h.key_bytes(PROMPT, 10, 1)
    h.close()
