"""GPU check of the connector's CUDA path (kvstore_connector/cuda_copy.py) on a machine with an NVIDIA GPU, in one short run.

1. DMA bandwidth: a real daemon's arena registered as pinned, device-mapped memory (CudaCopier does
   cudaHostRegister), host->device and device->host for 256 blocks of 2 MiB in reserved arena slots through
   CudaCopier's kernel, against torch's own pinned-memory copy of the same bytes (torch.empty(pin_memory=True)
   .copy_(non_blocking=True)) as the limit; plus, informational, cudaMemcpyAsync (torch .copy_) per block
   straight from the registered arena. Bytes are verified both ways.
2. WorkerSide save + load with model-shaped CUDA KV tensors (32 layers of (2, num_blocks, 16, 8, 128) bf16):
   save a prompt's blocks, load them into other blocks, compare every block on the GPU.
3. Overwrite during a save: a save's gather is launched while the "forward" still holds the compute stream,
   and the next step at once overwrites the same GPU blocks (vLLM frees a finished request's blocks when
   wait_for_save returns and may reuse them in the next step). The stored blocks must hold the bytes of the
   save, not the overwrite: CudaCopier.fence orders the compute stream after the gather. Each round checks
   that the gather was still in flight when the overwrite was issued (else the round proves nothing and the
   run fails); one more round with the fence disabled says whether the check would catch a missing fence.
4. Per-tenant arena files (tokens on): the GPU pins a tenant's sparse file slab by slab; after its slabs
   moved to another tenant and back (new pages in its file), its copier must re-pin them: blocks written from
   the GPU before and after must read back exactly through the daemon.
5. Hybrid model (bench/gpu_hybrid.py): two KV cache groups (full + sliding window) whose layers alias one backing
   allocation in vLLM 0.33's default GPU layout (LBNHC: per-layer views permuted from token-major pages), bf16;
   the scheduler's per-group jobs (the sliding group trimmed to its window, -1 elsewhere) saved and loaded into
   other blocks: every loaded page equals the saved one, every other page keeps a sentinel, and the daemon holds
   exactly each group's keys. GB/s quoted against the DMA kernel's.
6. Optional (--e2e, when `import vllm` works): the end-to-end suite tests/vllm_e2e with this interpreter.

Without CUDA (torch.cuda.is_available() is False) it prints why it skipped and exits 0. Exit 1 when a check
fails. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

from bench._common import fmt_bytes, print_table
from bench.gpu_checks import (BLOCK, KV_KEYS, LAYERS, MIB, N_BLOCKS, NS, REPS, dma_check, save_load_check,
                              tenant_pins_check)
from bench.gpu_hybrid import HYBRID_ROUNDS, hybrid_arena_bytes, hybrid_save_load_check
from bench.gpu_overwrite import (FORWARD_MS, OVERWRITE_ROUNDS, OVERWRITE_VALUE, _CopySpy,
                                 overwrite_during_save_check)

# The checks live in bench/gpu_checks.py, bench/gpu_overwrite.py and bench/gpu_hybrid.py; their names stay
# importable from here.
__all__ = ["main", "e2e_check", "dma_check", "tenant_pins_check", "save_load_check", "overwrite_during_save_check",
           "hybrid_save_load_check", "_CopySpy", "BLOCK", "KV_KEYS", "LAYERS", "N_BLOCKS", "OVERWRITE_ROUNDS",
           "OVERWRITE_VALUE", "FORWARD_MS"]


def e2e_check(run: bool) -> str:
    """The vLLM end-to-end check: tests/vllm_e2e with this interpreter when --e2e.

    The test needs no weights (a tiny Llama config with load_format="dummy"), so with a CUDA build of vLLM
    (e.g. .venv-vllm, vllm 0.33) on a GPU machine the KV cache lives on the GPU and every save and load goes
    through CudaCopier: hits across reset_prefix_cache and processes, identical tokens, corruption detected."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        return f"skipped: vllm not importable ({exc.__class__.__name__})"
    if not run:
        return "not run (pass --e2e)"
    suite = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "vllm_e2e")
    if not os.path.isdir(suite):
        return f"skipped: {suite} is missing"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", suite],
                       capture_output=True, text=True, timeout=900)
    tail = (p.stdout.strip().splitlines() or [""])[-1]
    return f"{'passed' if p.returncode == 0 else 'FAILED'}: {tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--e2e", action="store_true", help="also run tests/vllm_e2e when vllm imports")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        why = "torch.cuda.is_available() is False (no NVIDIA GPU or no CUDA build of torch)"
        print(f"SKIPPED: GPU check not run: {why}.")
        print(json.dumps({"cuda": False, "skipped": why}))
        return 0
    try:
        import cupy
    except ImportError as exc:
        print(f"FAILED: CUDA is available but cupy is not ({exc}): pip install 'kvstore[gpu]' (cupy-cuda12x)")
        print(json.dumps({"cuda": True, "error": f"cupy missing: {exc}"}))
        return 1
    from kvstore.client import Client
    from kvstore.testing import DaemonProcess

    device = "cuda:0"
    out: dict[str, Any] = {"cuda": True, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "cupy": cupy.__version__}
    t0 = time.perf_counter()
    arena = BLOCK * N_BLOCKS + 3 * KV_KEYS * 2 * MIB * 2 + (OVERWRITE_ROUNDS + 1) * KV_KEYS * 2 * MIB
    arena += hybrid_arena_bytes() + 256 * MIB
    try:
        with DaemonProcess(arena_bytes=arena, max_block_bytes=BLOCK) as d, Client(d.address) as c:
            if c.mode != "arena":
                raise RuntimeError(f"expected the arena path, got {c.mode}")
            c.register_namespace(NS)
            out.update(dma_check(c, torch, device))
            out.update(save_load_check(d.address, torch, device))
            out.update(overwrite_during_save_check(d.address, torch, device))
            out.update(hybrid_save_load_check(d.address, torch, device))
        with tempfile.TemporaryDirectory(prefix="kvstore-gpu-pins-") as work:
            out.update(tenant_pins_check(torch, device, work))
    except Exception as exc:  # noqa: BLE001 - report it as the run's result, with the JSON line last
        traceback.print_exc()
        print(f"FAILED: {exc.__class__.__name__}: {exc} (a RawKernel compile error means NVRTC is missing: "
              "pip install nvidia-cuda-nvrtc-cu12, which cupy-cuda12x loads)")
        print(json.dumps({**out, "error": f"{exc.__class__.__name__}: {exc}"}, sort_keys=True), flush=True)
        return 1
    out["hybrid_save_vs_dma"] = out["hybrid_save_gbs"] / out["d2h_gbs"] if out["d2h_gbs"] else 0.0
    out["hybrid_load_vs_dma"] = out["hybrid_load_gbs"] / out["h2d_gbs"] if out["h2d_gbs"] else 0.0
    out["e2e"] = e2e_check(args.e2e)
    out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    out = {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}
    nb = fmt_bytes(BLOCK * N_BLOCKS)
    print_table(f"DMA through the registered arena vs torch's pinned copy ({N_BLOCKS} x {fmt_bytes(BLOCK)} = {nb}; "
                f"GB/s of the median of {REPS})", ["direction", "CudaCopier kernel", "torch pinned .copy_", "ratio",
                                                   "cudaMemcpyAsync from arena", "bytes ok"],
                [["host -> device", out["h2d_gbs"], out["torch_h2d_gbs"], out["h2d_ratio"],
                  out["arena_memcpy_h2d_gbs"], out["dma_h2d_ok"]],
                 ["device -> host", out["d2h_gbs"], out["torch_d2h_gbs"], out["d2h_ratio"], "", out["dma_d2h_ok"]]])
    print_table(f"WorkerSide with CUDA KV ({KV_KEYS} keys, {fmt_bytes(out['kv_bytes'])} a pass)",
                ["check", "value"], [["save GB/s (save + drain)", out["save_gbs"]],
                                     ["load GB/s (start_loads + drain)", out["load_gbs"]],
                                     ["bytes round-trip exactly", out["save_load_ok"]], ["vLLM e2e", out["e2e"]]])
    print_table(f"Overwrite of the saved GPU blocks while the save's gather is in flight ({OVERWRITE_ROUNDS} rounds "
                f"behind a {FORWARD_MS} ms forward)", ["check", "value"],
                [["gather still in flight when the overwrite was issued, every round",
                  out["overwrite_gather_in_flight"]],
                 ["layers whose stored bytes differ from the saved ones", out["overwrite_mismatched_layers"]],
                 ["without the fence: layers that differ (informational)",
                  out.get("overwrite_unfenced_mismatched_layers", "")],
                 ["stored bytes are the pre-overwrite bytes", out["overwrite_ok"]]])
    print_table("Per-tenant arena files: GPU pins follow slabs that move between tenants", ["check", "value"],
                [["blocks written from the GPU read back exactly, before and after the slabs moved",
                  out["tenant_pins_ok"]], ["slab registrations (re-pins included)", out["tenant_pins_registrations"]],
                 ["slab moves between tenants' files", out["tenant_pins_slab_binds"]]])
    print_table(f"Hybrid model: full + sliding-window ({out['hybrid_window']} tokens) KV cache groups aliasing one "
                f"{out['hybrid_layout']} bf16 allocation ({out['hybrid_keys']} keys of "
                f"{fmt_bytes(out['hybrid_key_bytes'])}, "
                f"{HYBRID_ROUNDS} rounds, GB/s of the median after a warm-up)", ["check", "value"],
                [["keys saved per group (full, sliding: its window only)", out["hybrid_saved_keys"]],
                 ["keys loaded per group; vLLM blocks filled", f"{out['hybrid_loaded_keys']}; "
                  f"{out['hybrid_loaded_blocks']}"],
                 ["save GB/s (save + drain); ratio to the DMA kernel's d2h", f"{out['hybrid_save_gbs']:.2f}; "
                  f"{out['hybrid_save_vs_dma']:.2f}"],
                 ["load GB/s (start_loads + drain); ratio to the DMA kernel's h2d", f"{out['hybrid_load_gbs']:.2f}; "
                  f"{out['hybrid_load_vs_dma']:.2f}"],
                 ["loaded pages whose bytes differ from the saved ones", out["hybrid_mismatched_pages"]],
                 ["other pages (-1 blocks, sources, spares) that lost the sentinel", out["hybrid_touched_pages"]],
                 ["rounds with wrong counters / wrong keys in the daemon / failed loads",
                  f"{out['hybrid_bad_counts']} / {out['hybrid_bad_store']} / {out['hybrid_bad_loads']}"],
                 ["hybrid save + load exact", out["hybrid_ok"]]])
    ok = (out["dma_bytes_ok"] and out["save_load_ok"] and out["overwrite_ok"] and out["tenant_pins_ok"]
          and out["hybrid_ok"] and not out["e2e"].startswith("FAILED"))
    print("OK: every check passed" if ok else "FAILED: see the tables above")
    print(json.dumps(out, sort_keys=True), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
