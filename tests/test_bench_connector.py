"""bench.connector at a tiny size: the JSON fields exist and the pass counters are exact (timings are not
checked), and a run that moves nothing fails instead of reporting a number."""

from __future__ import annotations

import json

import pytest

from bench import connector as bench
from kvstore_connector.copier import CpuCopier
from kvstore_connector.worker import WorkerSide

TOKENS = 64  # 4 vLLM blocks of 2 MiB = 4 keys


def test_core_reports_every_field_and_exact_counters() -> None:
    out, rows = bench.run(TOKENS, rounds=2, warmup=1, threads=(1, 2), head_chunk=16, extra_chunks=(0, 32), sample=2)
    json.dumps(out)
    for k in ("bytes", "memcpy_gbs", "save_gbs", "load_gbs", "save_ratio", "load_ratio", "save_t1_gbs",
              "load_t1_gbs", "save_chunk0_gbs", "save_chunk32_gbs", "copy_threads", "wait_for_save_ms_p50",
              "memcpy_numpy_gbs"):
        assert k in out, k
    # the limit is the faster native copy (1 or 2 threads), and every ratio divides by it, not by np.copyto
    native = {t: out[f"memcpy_native{t}_gbs"] for t in (1, 2)}
    assert out["limit_threads"] == max(native, key=native.__getitem__)
    assert out["limit_gbs"] == out["memcpy_gbs"] == native[out["limit_threads"]]
    assert out[f"memcpy_native{out['limit_threads']}_ratio"] == 1.0
    for op in ("save", "load", "save_t1", "load_t1"):
        # ratios are printed with 3 decimals: within half of the last one, or 1 %
        assert out[f"{op}_ratio"] == pytest.approx(out[f"{op}_gbs"] / out["limit_gbs"], rel=0.01, abs=5e-4), op
    assert (out["bytes"], out["keys"], out["steps_per_prompt"], out["copy_threads"]) == (4 << 21, 4, 4, 2)
    assert out["copy_threads_measured"] == [1, 2] and set(out["targets_met"]) == {"save_ratio", "load_ratio"}
    # (warm-up + timed rounds) x (2 thread counts + 2 extra step sizes), + the instrumented pass
    saves, loads = 3 * (2 + 2) + 1, 3 * 2 + 1
    ck = out["checks"]
    assert (ck["save_passes"], ck["saved_blocks"]) == (saves, 4 * saves)
    assert (ck["load_passes"], ck["loaded_blocks"]) == (loads, 4 * loads)
    assert ck["sample_blocks_compared"] == loads * ck["sample_blocks"] and ck["sample_blocks"] >= 2
    assert len(rows) == 3 + 2 * 2 + 2   # native x1, x2, np.copyto; save and load x 2 thread counts; 2 step sizes
    # one key a step: every part goes through spare slots (a Store on the commit thread), none reserves
    assert set(out["phases_ms"]) == {"save", "load"} and out["phases_ms"]["save"]["Store RPC"] > 0
    assert "Reserve RPC" not in out["phases_ms"]["save"] and "spare slots taken" in out["phases_ms"]["save"]


def test_a_save_that_stores_nothing_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(WorkerSide, "save", lambda self, jobs: None)
    with pytest.raises(bench.BenchError, match="expected 4 keys saved"):
        bench.run(TOKENS, rounds=1, warmup=0, threads=(2,), extra_chunks=())


def test_copies_that_move_no_bytes_fail_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CpuCopier, "copy", lambda self, plan, after=None: None)   # counters still say "saved", "loaded"
    with pytest.raises(bench.BenchError, match="differ from the bytes saved"):
        bench.run(TOKENS, rounds=1, warmup=0, threads=(2,), extra_chunks=())


def test_main_prints_the_json_object_last(capsys: pytest.CaptureFixture[str]) -> None:
    bench.main(["--tokens", str(TOKENS), "--rounds", "1", "--threads", "2", "--chunk", "32"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    out = json.loads(last)
    assert out["tokens"] == TOKENS and out["chunk_tokens"] == 32 and out["copy_threads_measured"] == [2]
