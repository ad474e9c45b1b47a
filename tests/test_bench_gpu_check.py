"""bench.gpu_check on a machine without CUDA: a clean skip (exit 0, a clear message, a JSON last line)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would really run")
def test_gpu_check_skips_cleanly_without_cuda() -> None:
    p = subprocess.run([sys.executable, "-m", "bench.gpu_check"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert lines[0].startswith("SKIPPED: GPU check not run: torch.cuda.is_available() is False")
    assert json.loads(lines[-1])["cuda"] is False


# -- the overwrite-during-save scenario, on CPU tensors ------------------------------------------------------
# On a GPU machine bench.gpu_check runs it with CUDA tensors behind a busy forward (the gather still in
# flight when the overwrite is issued). Here its code path runs with the CPU copier, whose gather is done
# when save() returns; a copier that defers its gather to the commit thread (what an unfenced asynchronous
# gather amounts to) must make the same check fail.

def test_overwrite_after_save_keeps_the_saved_bytes(daemon) -> None:
    from bench.gpu_check import OVERWRITE_ROUNDS, overwrite_during_save_check

    out = overwrite_during_save_check(daemon.address, torch, "cpu", keys=4)
    assert out == {"overwrite_rounds": OVERWRITE_ROUNDS, "overwrite_mismatched_layers": 0,
                   "overwrite_not_in_flight": 0, "overwrite_gather_in_flight": None, "overwrite_ok": True}


def test_a_gather_that_runs_after_the_overwrite_is_caught(daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes

    import numpy as np

    from bench.gpu_check import LAYERS, OVERWRITE_ROUNDS, OVERWRITE_VALUE, overwrite_during_save_check
    from kvstore_connector.copier import CpuCopier
    from kvstore_connector.worker import WorkerSide
    from kvstore._native import copy_addrs
    from kvstore.testing import wait_until

    bits = torch.tensor(OVERWRITE_VALUE, dtype=torch.bfloat16).view(torch.int16).item() & 0xFFFF
    cache: list[tuple[int, int]] = []   # address ranges of the registered KV tensors
    register = WorkerSide.register

    def spy_register(self: WorkerSide, kv_caches: dict, num_blocks: int) -> None:
        cache.extend((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in kv_caches.values())
        register(self, kv_caches, num_blocks)

    def is_save(plan) -> bool:          # a save gathers from the KV cache; a load reads the arena
        return any(lo <= int(plan.src[0]) < hi for lo, hi in cache)

    def overwritten(plan) -> bool:      # every source piece of the gather holds the next step's value
        return all(bool((np.ctypeslib.as_array((ctypes.c_uint16 * (int(n) // 2)).from_address(int(a))) == bits).all())
                   for a, n in zip(plan.src, plan.lengths))

    def deferred_copy(self: CpuCopier, plan, after: object = None):
        if not (len(plan.lengths) and is_save(plan)):
            return copy_addrs(plan.dst, plan.src, plan.lengths, threads=self.threads) and None
        return plan                     # a save's gather, not run yet: "in flight"

    def deferred_wait(self: CpuCopier, plan) -> None:   # the commit thread waits: the gather runs now, after the
        if plan is not None:                             # next step's overwrite (what a missing fence allows)
            wait_until(lambda: overwritten(plan), timeout_s=10, interval_s=0.001, what="the next step's overwrite")
            copy_addrs(plan.dst, plan.src, plan.lengths, threads=self.threads)

    monkeypatch.setattr(WorkerSide, "register", spy_register)
    monkeypatch.setattr(CpuCopier, "copy", deferred_copy)
    monkeypatch.setattr(CpuCopier, "wait", deferred_wait)
    out = overwrite_during_save_check(daemon.address, torch, "cpu", keys=4)
    assert out["overwrite_mismatched_layers"] == OVERWRITE_ROUNDS * LAYERS and out["overwrite_ok"] is False


def test_the_cuda_spy_patches_and_restores_the_copier_class() -> None:
    # The CUDA rounds observe the worker's own CudaCopier through class attributes; they must be put back.
    from bench.gpu_check import _CopySpy
    from kvstore_connector.cuda_copy import CudaCopier

    copy, fence = CudaCopier.copy, CudaCopier.fence
    spy = _CopySpy(cuda=True)
    assert CudaCopier.copy is not copy
    spy.fence(False)
    assert CudaCopier.fence is not fence
    spy.fence(True)
    assert CudaCopier.fence is fence
    spy.fence(False)
    spy.close()
    assert (CudaCopier.copy, CudaCopier.fence) == (copy, fence)


# -- the hybrid-model check (two KV cache groups aliasing one LBNHC allocation), on CPU tensors ------------------
# On a GPU machine bench.gpu_check runs it with CUDA tensors and CudaCopier; here the same code runs with the CPU
# copier. 8 keys of 2 vLLM blocks (32 tokens), window 40 tokens: at the hit of 256 tokens vLLM keeps the sliding
# group's blocks 13..15 (tokens 217..), so the sliding group saves keys 6 and 7 and loads 3 blocks (key 6's block
# 12 is -1 in the LoadJob). Counts per round; 4 rounds, 2 layers per group (pages: one layer's one vLLM block).

HYBRID_EXACT = {"hybrid_mismatched_pages": 0, "hybrid_touched_pages": 0, "hybrid_bad_counts": 0,
                "hybrid_bad_store": 0, "hybrid_bad_loads": 0, "hybrid_rounds": 4, "hybrid_layout": "LBNHC",
                "hybrid_keys": 8, "hybrid_window": 40, "hybrid_blocks_per_key": 2, "hybrid_key_bytes": 2 * 2 * 65536,
                "hybrid_saved_keys": [8, 2], "hybrid_loaded_keys": [8, 2], "hybrid_loaded_blocks": [16, 3],
                "hybrid_save_bytes": 10 * 262144, "hybrid_load_bytes": 19 * 131072, "hybrid_ok": True}


def test_hybrid_plan_trims_the_sliding_group_as_the_scheduler_does() -> None:
    from bench.gpu_hybrid import hybrid_plan

    p = hybrid_plan(8, 40, 2)
    assert p.num_blocks == 1 + 16 + 4 + 16 + 3 + 8
    assert p.save_ids[1][:12] == [-1] * 12 and min(p.save_ids[1][12:]) > 0
    assert p.load_ids[1][:13] == [-1] * 13 and min(p.load_ids[1][13:]) > 0 and min(p.load_ids[0]) > 0
    used = [b for ids in p.save_ids + p.load_ids for b in ids if b >= 0]
    assert len(used) == len(set(used)) == 16 + 4 + 16 + 3 and 0 not in used   # disjoint, never the null block
    assert p.pairs[1] == list(zip(p.load_ids[1][13:], p.save_ids[1][13:]))


def test_hybrid_check_round_trips_both_groups_of_one_aliased_allocation(daemon) -> None:
    from bench.gpu_hybrid import hybrid_save_load_check

    out = hybrid_save_load_check(daemon.address, torch, "cpu", keys=8, window=40)
    assert out["hybrid_save_gbs"] > 0 and out["hybrid_load_gbs"] > 0
    assert {k: v for k, v in out.items() if not k.endswith("_gbs")} == HYBRID_EXACT


def test_hybrid_check_catches_a_group_whose_load_is_dropped(daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sliding group's parts report success but copy nothing: its 3 destination blocks keep the sentinel
    (2 layers x 3 pages a round) and the loaded bytes fall short, while the keys count as loaded."""
    from bench.gpu_hybrid import hybrid_save_load_check
    from kvstore_connector.worker import WorkerSide

    load_part = WorkerSide._load_part

    def drop_sliding(self: WorkerSide, c, ns, group, *args, **kw):
        return 0 if group == 1 else load_part(self, c, ns, group, *args, **kw)

    monkeypatch.setattr(WorkerSide, "_load_part", drop_sliding)
    out = hybrid_save_load_check(daemon.address, torch, "cpu", keys=8, window=40)
    assert out["hybrid_ok"] is False
    assert (out["hybrid_mismatched_pages"], out["hybrid_touched_pages"], out["hybrid_bad_counts"],
            out["hybrid_bad_store"], out["hybrid_bad_loads"]) == (4 * 2 * 3, 0, 4, 0, 0)
    assert out["hybrid_counts_seen"] == {"saved_blocks": 10, "saved_bytes": 10 * 262144, "save_failures": 0,
                                         "save_skipped_blocks": 0, "loaded_blocks": 10,
                                         "loaded_bytes": 16 * 131072, "load_failed_blocks": 0}


def test_hybrid_check_catches_groups_that_share_a_namespace(daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both groups' layers are the same bytes, but at other blocks: a sliding key stored and loaded under the full
    group's name brings the full group's bytes into the sliding blocks. The sliding saves find the keys present
    (skipped), its namespace stays empty, and every sliding page loaded differs."""
    from dataclasses import replace

    import kvstore_connector.saves
    import kvstore_connector.worker
    from bench.gpu_hybrid import hybrid_save_load_check
    from kvstore_connector.groups import FULL

    real = kvstore_connector.worker.namespace_for
    for module in (kvstore_connector.worker, kvstore_connector.saves):  # loads, saves
        monkeypatch.setattr(module, "namespace_for",
                            lambda spec, salt=None, tenant="":
                            real(replace(spec, kind=FULL, group_index=0), salt, tenant))
    out = hybrid_save_load_check(daemon.address, torch, "cpu", keys=8, window=40)
    assert out["hybrid_ok"] is False
    assert (out["hybrid_mismatched_pages"], out["hybrid_touched_pages"], out["hybrid_bad_counts"],
            out["hybrid_bad_store"], out["hybrid_bad_loads"]) == (4 * 2 * 3, 0, 4, 4, 0)
    assert out["hybrid_counts_seen"]["save_skipped_blocks"] == 2
