"""GPU check of the connector's CUDA path (connector/cuda_copy.py) on a machine with an NVIDIA GPU, in one short run.

1. DMA bandwidth: a real daemon's arena registered as pinned, device-mapped memory (CudaCopier does
   cudaHostRegister), host->device and device->host for 256 blocks of 2 MiB in reserved arena slots through
   CudaCopier's kernel, against torch's own pinned-memory copy of the same bytes (torch.empty(pin_memory=True)
   .copy_(non_blocking=True)) as the limit; plus, informational, cudaMemcpyAsync (torch .copy_) per block
   straight from the registered arena. Bytes are verified both ways.
2. WorkerSide save + load with model-shaped CUDA KV tensors (32 layers of (2, num_blocks, 16, 8, 128) bf16):
   save a prompt's blocks, load them into other blocks, compare every block on the GPU.
3. Optional (--e2e, when `import vllm` works): the end-to-end suite tests/vllm_e2e with this interpreter.

Without CUDA (torch.cuda.is_available() is False) it prints why it skipped and exits 0. Exit 1 when a check
fails. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from bench._common import fmt_bytes, gbs, print_table

MIB = 1 << 20
BLOCK, N_BLOCKS = 2 * MIB, 256
LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 32, 8, 128, 16
KV_KEYS = 128                                  # 128 x 2 MiB = 256 MiB per save / load pass
REPS = 5
NS = "gpu-check"


def _median_s(fn: Callable[[], object], sync: Callable[[], object], reps: int = REPS) -> float:
    fn()
    sync()                                     # warm-up: kernel compile, first-touch of mappings
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _arena_bytes(base: int, size: int) -> np.ndarray:
    """The mapped arena as a numpy byte array (this process's mapping)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(base))


def dma_check(client: Any, torch: Any, device: str) -> dict[str, Any]:
    """Kernel H2D/D2H through the registered arena vs torch's pinned copy; exact bytes both ways."""
    from connector.cuda_copy import CudaCopier
    from connector.layout import CopyPlan

    nbytes = BLOCK * N_BLOCKS
    keys = [f"dma-{i}".encode() for i in range(N_BLOCKS)]
    res = client.reserve(NS, keys, [BLOCK] * N_BLOCKS)     # real slots, so the daemon never hands them out
    if sum(1 for o in res.outcomes if o == 0) != N_BLOCKS:
        raise RuntimeError(f"reserve of {N_BLOCKS} x 2 MiB slots gave outcomes {sorted(set(res.outcomes))}")
    base, size = client.arena_span
    arena = _arena_bytes(base, size)
    offs = np.asarray(res.offsets, dtype=np.uint64)
    rng = np.random.default_rng(0)
    pattern = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
    for i, o in enumerate(res.offsets):
        arena[o:o + BLOCK] = pattern[i * BLOCK:(i + 1) * BLOCK]
    gpu = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    g_addrs = np.uint64(gpu.data_ptr()) + np.arange(N_BLOCKS, dtype=np.uint64) * np.uint64(BLOCK)
    lens = np.full(N_BLOCKS, BLOCK, dtype=np.uint64)
    h_addrs = np.uint64(base) + offs
    h2d = CopyPlan(g_addrs, h_addrs, lens)
    d2h = CopyPlan(h_addrs, g_addrs, lens)
    out: dict[str, Any] = {"dma_blocks": N_BLOCKS, "dma_block_bytes": BLOCK}
    copier = CudaCopier((base, size), device)
    sync = torch.cuda.synchronize
    try:
        out["h2d_gbs"] = gbs(nbytes, _median_s(lambda: copier.wait(copier.copy(h2d)), sync))
        want = torch.from_numpy(pattern).to(device)
        h2d_ok = bool(torch.equal(gpu, want))
        gpu.copy_(torch.flip(want, dims=[0]))                # different bytes for the way back
        sync()
        out["d2h_gbs"] = gbs(nbytes, _median_s(lambda: copier.wait(copier.copy(d2h)), sync))
        back = pattern[::-1]
        d2h_ok = all(np.array_equal(arena[o:o + BLOCK], back[i * BLOCK:(i + 1) * BLOCK])
                     for i, o in enumerate(res.offsets))
        # informational: the copy engine (cudaMemcpyAsync, one per block) straight from the registered arena
        at = torch.frombuffer((ctypes.c_uint8 * size).from_address(base), dtype=torch.uint8)
        out["arena_pinned_seen_by_torch"] = bool(at.is_pinned())

        def engine_h2d() -> None:
            for i, o in enumerate(res.offsets):
                gpu[i * BLOCK:(i + 1) * BLOCK].copy_(at[o:o + BLOCK], non_blocking=True)
        out["arena_memcpy_h2d_gbs"] = gbs(nbytes, _median_s(engine_h2d, sync))
    finally:
        copier.close()                                       # unregisters: the worker below registers again
        client.abort(res)
    # the limit: torch's own pinned buffer, one copy each way
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(torch.from_numpy(pattern))
    out["torch_h2d_gbs"] = gbs(nbytes, _median_s(lambda: gpu.copy_(pinned, non_blocking=True), sync))
    out["torch_d2h_gbs"] = gbs(nbytes, _median_s(lambda: pinned.copy_(gpu, non_blocking=True), sync))
    out["h2d_ratio"] = out["h2d_gbs"] / out["torch_h2d_gbs"]
    out["d2h_ratio"] = out["d2h_gbs"] / out["torch_d2h_gbs"]
    out["dma_bytes_ok"] = h2d_ok and d2h_ok
    out["dma_h2d_ok"], out["dma_d2h_ok"] = h2d_ok, d2h_ok
    return out


def save_load_check(address: str, torch: Any, device: str) -> dict[str, Any]:
    """WorkerSide with CUDA KV tensors: save KV_KEYS blocks, load them into other blocks, compare on the GPU."""
    from connector.config import ConnectorConfig
    from connector.keys import KeyChain, chain_root
    from connector.link import StoreLink
    from connector.namespace import KVLayoutSpec, registration
    from connector.plan import LoadJob, SaveJob
    from connector.worker import WorkerSide

    num_blocks = 2 * KV_KEYS
    shape = (2, num_blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM)
    gen = torch.Generator(device=device).manual_seed(0)
    caches = {f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=gen, device=device,
                                                              dtype=torch.float32).to(torch.bfloat16)
              for i in range(LAYERS)}
    config = ConnectorConfig.from_extra({"address": address})
    block_bytes = 2 * LAYERS * BLOCK_TOKENS * KV_HEADS * HEAD_DIM * 2
    g = config.resolve_blocks_per_key(block_bytes)
    spec = KVLayoutSpec("bench/gpu-check", "bfloat16", BLOCK_TOKENS, LAYERS, KV_HEADS, HEAD_DIM, 0, 1, g)
    link = StoreLink(address, timeout_s=config.load_timeout_s, namespace_spec=lambda _n: registration(spec))
    worker = WorkerSide(config, spec, link)
    worker.register(caches, num_blocks)
    if worker.layout is None or worker.layout.is_cuda != device.startswith("cuda"):
        raise RuntimeError(f"the worker side sees KV tensors on {worker.layout and worker.layout.device}")
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    src_blocks, dst_blocks = perm[:KV_KEYS * g], perm[KV_KEYS * g:]
    nbytes = KV_KEYS * g * block_bytes
    save_s, load_s, mismatched, rounds = [], [], 0, 3
    try:
        for r in range(rounds):
            keys = KeyChain(spec.tokens_per_key, r, chain_root(r)).extend(list(range(KV_KEYS * spec.tokens_per_key)))
            before = dict(worker.counters.totals)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            worker.save([SaveJob(f"save-{r}", None, keys, src_blocks)])   # the kernel runs after the "forward"
            worker.drain()
            save_s.append(time.perf_counter() - t0)
            saved = worker.counters.totals.get("saved_blocks", 0) - before.get("saved_blocks", 0)
            for t in caches.values():
                t[:, dst_blocks] = 0                         # the load must bring every byte back
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            worker.start_loads([LoadJob(f"load-{r}", None, keys, dst_blocks)])
            worker.drain()
            load_s.append(time.perf_counter() - t0)
            _, recv = worker.finished(set())
            failed = worker.load_errors()
            loaded = worker.counters.totals.get("loaded_blocks", 0) - before.get("loaded_blocks", 0)
            if saved != KV_KEYS or loaded != KV_KEYS or failed or recv != {f"load-{r}"}:
                raise RuntimeError(f"round {r}: saved {saved}, loaded {loaded} of {KV_KEYS} keys, "
                                   f"{len(failed)} failed blocks, received {recv}")
            torch.cuda.synchronize()
            mismatched += sum(int(not torch.equal(t[:, src_blocks], t[:, dst_blocks])) for t in caches.values())
    finally:
        worker.close()
        link.close()
    return {"save_load_ok": mismatched == 0, "save_load_mismatched_layers": mismatched, "kv_keys": KV_KEYS,
            "kv_bytes": nbytes, "save_gbs": gbs(nbytes, statistics.median(save_s)),
            "load_gbs": gbs(nbytes, statistics.median(load_s))}


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
    arena = BLOCK * N_BLOCKS + 3 * KV_KEYS * 2 * MIB * 2 + 256 * MIB
    try:
        with DaemonProcess(arena_bytes=arena, max_block_bytes=BLOCK) as d, Client(d.address) as c:
            if c.mode != "arena":
                raise RuntimeError(f"expected the arena path, got {c.mode}")
            c.register_namespace(NS)
            out.update(dma_check(c, torch, device))
            out.update(save_load_check(d.address, torch, device))
    except Exception as exc:  # noqa: BLE001 - report it as the run's result, with the JSON line last
        traceback.print_exc()
        print(f"FAILED: {exc.__class__.__name__}: {exc} (a RawKernel compile error means NVRTC is missing: "
              "pip install nvidia-cuda-nvrtc-cu12, which cupy-cuda12x loads)")
        print(json.dumps({**out, "error": f"{exc.__class__.__name__}: {exc}"}, sort_keys=True), flush=True)
        return 1
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
    ok = out["dma_bytes_ok"] and out["save_load_ok"] and not out["e2e"].startswith("FAILED")
    print("OK: every check passed" if ok else "FAILED: see the tables above")
    print(json.dumps(out, sort_keys=True), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
