"""Hybrid models (sliding-window and full layers) through vLLM on CPU with KVStoreConnector, the hybrid KV cache
manager (HMA) on, and a real daemon, end to end.

Numbers the assertions use (tests/vllm_e2e/hybrid_models.py): prompt 600 tokens, block 32, window 128, one stored
block per vLLM block. A repeat of the prompt can take 576 tokens (18 blocks) from the store; vLLM computes the rest.
A full-attention group stores all 18 blocks; a sliding-window group only what a hit at 576 needs: the window
before token 576 starts at token 449, in block 14, so blocks 14..17 (4 blocks). vLLM hands the group's other
blocks back while the prompt is computed (chunked prefill, 256 tokens a step), so they are never stored.

Each vLLM runs in its own process (hybrid_generate.py): a fresh vLLM, new random NONE_HASH, its own capacity.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from kvstore.client import Client
from tests.vllm_e2e.hybrid_models import MODELS, HybridModel, write_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HIT_TOKENS = 576            # 18 stored blocks of 32 tokens
FULL_BLOCKS = 18
SLIDING_BLOCKS = 4          # blocks 14..17
PAGE_BYTES = 32 * 2 * 2 * 64 * 4  # one layer, one block: 32 tokens, K and V, 2 KV heads of 64, float32
# vLLM's capacity (kv_cache_size_tokens) in 64 MiB, max_model_len 2048, 256 tokens a step: a request needs 64 blocks
# in a full group and cdiv(127 + 256, 32) + 1 = 13 in a sliding one (SlidingWindowSpec); with HMA off, every layer
# keeps 64. Gemma 3 style: 2048 blocks of one layer / (64 + 5 * 13) -> 15.88 x 2048 tokens; off: 341 blocks of
# 6 layers / 64 -> 5.33x. Gemma 2 style: 1024 blocks of 2 layers / (64 + 13) -> 13.30x; off: 512 of 4 / 64 -> 8x.
CAPACITY = {"gemma2": (27_235, 16_384), "gemma3": (32_513, 10_912)}  # (HMA on, HMA off)


def _run(*runs: str, address: str | None = None) -> list[dict]:
    """hybrid_generate.py in a fresh process (runs: MODEL_DIR:HMA:PHASES); its JSON lines."""
    cmd = [sys.executable, "-m", "tests.vllm_e2e.hybrid_generate", *runs]
    if address:
        cmd += ["--address", address]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONHASHSEED": "random"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def _namespaces(address: str) -> list[tuple[int, int]]:
    """(blocks, puts) of every connector namespace (one per KV cache group), sorted."""
    with Client(address) as c:
        return sorted((n.blocks, n.puts) for n in c.stats().namespaces if n.name.startswith("vllm/"))


@dataclass
class Reference:
    """A model written to disk, and what vLLM without a connector says about it: groups and capacity with HMA on
    and off, and the greedy tokens (HMA on)."""

    model: HybridModel
    path: str
    on: dict
    off: dict
    tokens: list[int]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Reference]:
    """Both models, served without a connector by four vLLMs in one process (one vLLM import, not four)."""
    paths = {m.name: write_model(m, str(tmp_path_factory.mktemp(f"{m.name}-e2e"))) for m in MODELS}
    lines = _run(*[f"{paths[m.name]}:{hma}:{'gen' if hma == 'on' else ''}" for m in MODELS for hma in ("on", "off")])
    out = {}
    for m in MODELS:
        mine = [x for x in lines if x["model_dir"] == paths[m.name]]
        (on,), (gen,), (off,) = ([x for x in mine if x["hma_asked"] == h and ("tokens" in x) == t]
                                 for h, t in (("on", False), ("on", True), ("off", False)))
        assert on["hma"] is True and off["hma"] is False and gen["num_cached_tokens"] == 0
        assert len(set(gen["tokens"])) > 3, gen  # the output depends on the context (see hybrid_models.py)
        out[m.name] = Reference(m, paths[m.name], on, off, gen["tokens"])
    return out


@pytest.mark.parametrize("name", [m.name for m in MODELS])
def test_hybrid_model_with_hma_on_hits_across_reset_and_processes(daemon, references, name: str) -> None:
    ref = references[name]
    m, expected = ref.model, ref.tokens
    stored = sorted([(SLIDING_BLOCKS, SLIDING_BLOCKS)] * m.sliding_groups + [(FULL_BLOCKS, FULL_BLOCKS)] * m.full_groups)
    blocks = m.sliding_groups * SLIDING_BLOCKS + m.full_groups * FULL_BLOCKS
    loaded_bytes = blocks * PAGE_BYTES * m.layers // m.groups  # every group of a model has as many layers

    info, first, again = _run(f"{ref.path}:on:gen,reset,gen", address=daemon.address)
    assert info["hma"] is True and info["groups"] == ref.on["groups"]
    assert [g["kind"] for g in info["groups"]].count("SlidingWindowSpec") == m.sliding_groups
    assert len(info["groups"]) == m.groups
    assert first["num_cached_tokens"] == 0 and first["tokens"] == expected
    assert _namespaces(daemon.address) == stored
    assert again["num_cached_tokens"] == HIT_TOKENS        # vLLM's cache was reset: these came from the store
    assert again["tokens"] == expected                      # identical greedy output from loaded KV
    saved = first["counters"]["worker"]
    assert (saved["saved_blocks"], saved["saved_bytes"], saved["save_skipped_blocks"]) == (blocks, loaded_bytes, 0)
    assert first["counters"]["scheduler"]["save_keys"] == FULL_BLOCKS  # keys per request; groups keep a subset
    sched, worker = again["counters"]["scheduler"], again["counters"]["worker"]
    assert (sched["hit_tokens"], sched["load_requests"]) == (HIT_TOKENS, 1)
    assert (worker["loaded_blocks"], worker["loaded_bytes"]) == (blocks, loaded_bytes)
    assert _namespaces(daemon.address) == stored             # the hit stored nothing new
    assert worker.get("load_failed_blocks", 0) == 0

    # A second vLLM in a new process: its very first request hits; then a load of corrupted bytes must change
    # what the model says (the loaded KV is really used, in every group that was loaded).
    _, fresh, corrupted, after = _run(f"{ref.path}:on:gen,corrupt,reset,gen", address=daemon.address)
    assert fresh["num_cached_tokens"] == HIT_TOKENS and fresh["tokens"] == expected
    assert fresh["counters"]["worker"]["loaded_blocks"] == blocks
    assert fresh["counters"]["worker"].get("saved_blocks", 0) == 0   # nothing stored twice
    assert corrupted["corrupted"] == blocks
    assert after["num_cached_tokens"] == HIT_TOKENS and after["tokens"] != expected


@pytest.mark.parametrize("name", [m.name for m in MODELS])
def test_hma_on_holds_more_tokens_than_off_in_the_same_kv_space(references, name: str) -> None:
    m, on, off = references[name].model, references[name].on, references[name].off
    assert len(on["groups"]) == m.groups and len(off["groups"]) == 1
    msg = (f"{m.name}: vLLM KV capacity {on['kv_cache_size_tokens']:,} tokens with HMA on "
           f"({on['max_concurrency']:.2f}x), {off['kv_cache_size_tokens']:,} with HMA off "
           f"({off['max_concurrency']:.2f}x), same KV space")
    print(msg)
    assert on["kv_cache_size_tokens"] > off["kv_cache_size_tokens"], msg
    assert (on["kv_cache_size_tokens"], off["kv_cache_size_tokens"]) == CAPACITY[m.name], msg
