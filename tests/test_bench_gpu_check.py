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
    from connector.copier import CpuCopier
    from connector.worker import WorkerSide
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
    from connector.cuda_copy import CudaCopier

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
