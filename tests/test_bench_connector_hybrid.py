"""bench.connector --model gemma3-like at a tiny size: what the daemon holds per KV cache group with window trimming
on and off, and what a hit at the prompt's end loads, against counts worked out here by hand (timings are not
checked); a run that stores or loads the wrong thing fails instead of reporting a number."""

from __future__ import annotations

import json

import pytest

from bench import connector as bench
from bench import connector_hybrid as hybrid
from bench.hybrid_rig import HybridShape
from kvstore_connector.copier import CpuCopier
from kvstore_connector.worker import WorkerSide

# 6 groups of 1 layer, 4 KV heads x 256, bf16, blocks of 16 tokens: one group's vLLM block is
# 2 (K, V) x 16 x 4 x 256 x 2 B = 64 KiB; the 6 groups' 384 KiB are under min_transfer_bytes (512 KiB), so the
# connector stores 2 vLLM blocks per key: 32 tokens, 128 KiB per group.
SHAPE = HybridShape(layers_per_group=1, kv_heads=4, head_dim=256, window=128)
TOKENS, CHUNK, CHECKPOINT = 1024, 256, 512
KEY_BYTES = 2 * (2 * 16 * 4 * 256 * 2)
KEYS = TOKENS // 32                     # 32 keys per group
# window_save "trim", sliding window 128: a hit at p tokens needs tokens from p - 127 on, i.e. blocks from
# (p - 127) // 16. Save points: 512 (the checkpoint), 992 (the same prompt again: vLLM computes its last token),
# 1024 (the next turn).   p=512: block 24 -> keys 12..15;  p=992: block 54 -> keys 27..30;  p=1024: block 56 ->
# keys 28..31. Union: keys 12..15 and 27..31 = 9 keys per sliding group.
TRIM_KEYS = [KEYS] + [9] * 5
ALL_KEYS = [KEYS] * 6
# the hit: 31 keys (992 tokens); a sliding group loads keys from block 54 on = key 27: keys 27..30
LOAD_KEYS = [31] + [4] * 5
ROUNDS, WARMUP = 2, 1


def test_stored_and_loaded_bytes_per_group_are_exact() -> None:
    out, rows = hybrid.run(TOKENS, rounds=ROUNDS, warmup=WARMUP, chunk=CHUNK, shape=SHAPE, checkpoint=CHECKPOINT,
                           sample=2)
    json.dumps(out)
    assert (out["blocks_per_key"], out["tokens_per_key"], out["key_bytes"]) == (2, 32, KEY_BYTES)
    assert out["steps_per_prompt"] == TOKENS // CHUNK == 4
    assert (out["stored_keys_trim"], out["stored_keys_all"]) == (TRIM_KEYS, ALL_KEYS)
    assert out["stored_bytes_trim"] == 77 * KEY_BYTES and out["stored_bytes_all"] == 192 * KEY_BYTES
    assert out["stored_bytes_per_token_trim"] == 77 * KEY_BYTES / TOKENS == 9856.0
    assert out["stored_bytes_per_token_all"] == 192 * KEY_BYTES / TOKENS == 24576.0
    assert out["trim_saving"] == round(192 / 77, 3)
    assert (out["hit_tokens"], out["load_keys"], out["load_bytes"]) == (992, LOAD_KEYS, 51 * KEY_BYTES)
    # each save and each load checked itself: (warm-up + rounds) passes per window_save mode
    passes = (WARMUP + ROUNDS) * 2
    ck = out["checks"]
    assert (ck["save_passes"], ck["saved_keys"]) == (passes, (WARMUP + ROUNDS) * (77 + 192))
    assert (ck["load_passes"], ck["loaded_keys"]) == (passes, passes * 51)
    assert ck["sample_blocks_compared"] == passes * ck["sample_blocks"] and ck["sample_blocks"] >= 12
    # every ratio divides the limit (the faster native copy of the same bytes) by the product, same run
    for m in ("trim", "all"):
        for op in ("save", "load"):
            ratio = out[f"{op}_gbs_{m}"] / out[f"limit_{op}_{m}_gbs"]    # of rounded values: 0.001 apart
            assert out[f"{op}_ratio_{m}"] == pytest.approx(ratio, rel=0.01, abs=2e-3), (op, m)
            assert out[f"limit_{op}_{m}_threads"] in (1, 2)
    assert (out["save_ratio"], out["load_ratio"], out["limit_gbs"]) == (
        out["save_ratio_trim"], out["load_ratio_trim"], out["limit_save_trim_gbs"])
    assert set(out["targets_met"]) == {"save_ratio", "load_ratio"}
    assert [r[:4] for r in rows] == [["save", "trim", "9856 KiB", ROUNDS], ["load", "trim", "6528 KiB", ROUNDS],
                                     ["save", "all", "24 MiB", ROUNDS], ["load", "all", "6528 KiB", ROUNDS]]


def test_a_worker_that_saves_only_the_full_group_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    parts = WorkerSide._parts
    monkeypatch.setattr(WorkerSide, "_parts", lambda self, job: [p for p in parts(self, job) if p[0] == 0])
    with pytest.raises(hybrid.BenchError, match="expected 77 keys saved"):
        hybrid.run(TOKENS, rounds=1, warmup=0, chunk=CHUNK, shape=SHAPE, checkpoint=CHECKPOINT)


def test_copies_that_move_no_bytes_fail_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CpuCopier, "copy", lambda self, plan, after=None: None)   # counters still say "loaded"
    with pytest.raises(hybrid.BenchError, match="differ from the bytes saved"):
        hybrid.run(TOKENS, rounds=1, warmup=0, chunk=CHUNK, shape=SHAPE, checkpoint=CHECKPOINT)


def test_bench_connector_dispatches_gemma3_like_and_prints_the_json_last(capsys: pytest.CaptureFixture[str]) -> None:
    bench.main(["--model", "gemma3-like", "--tokens", "1024", "--rounds", "1", "--chunk", "512", "--threads", "2"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the default shape: 6 groups x 2 layers, window 1024 > the prompt, so trimming keeps every key
    assert (out["model"], out["tokens"], out["chunk_tokens"], out["copy_threads"]) == ("gemma3-like", 1024, 512, 2)
    assert (out["blocks_per_key"], out["key_bytes"]) == (1, 2 * 2 * 16 * 4 * 256 * 2)
    assert out["stored_keys_trim"] == out["stored_keys_all"] == [64] * 6 and out["trim_saving"] == 1.0
