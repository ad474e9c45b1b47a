"""GPU check of the connector's CUDA path (connector/cuda_copy.py) on a machine with an NVIDIA GPU, in one short run.

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
5. Optional (--e2e, when `import vllm` works): the end-to-end suite tests/vllm_e2e with this interpreter.

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
import tempfile
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
OVERWRITE_ROUNDS = 2            # fenced rounds of the overwrite check (+ 1 without the fence, on CUDA)
FORWARD_MS = 50                 # how long the stand-in forward holds the compute stream before each save
OVERWRITE_VALUE = 7.0           # what the "next step" writes into the saved blocks (bf16-exact, never random)


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
    mapping = client.acquire_arena(res.incarnation)         # held for every copy through it (arena_map.py)
    if mapping is None:
        raise RuntimeError("the client has no arena mapping of the reservation's daemon")
    copier = CudaCopier(mapping, device)
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
        mapping.release()
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


def tenant_pins_check(torch: Any, device: str, workdir: str) -> dict[str, Any]:
    """With tokens every tenant's arena is a sparse file of its own and the GPU pins it slab by slab
    (connector/pinning.py). Alice writes blocks from the GPU, deletes them; bob takes every slab (they leave
    alice's file and are punched out of it); bob deletes his; alice writes again into slabs that came back with
    new pages. Her copier must re-pin them (a stale pin would DMA into orphaned pages and the daemon would see
    zeros): every block read back through the daemon must equal the GPU bytes."""
    from connector.cuda_copy import CudaCopier
    from connector.layout import CopyPlan
    from kvstore.client import Client
    from kvstore.testing import DaemonProcess

    def secret(name: str, text: str) -> str:
        path = os.path.join(workdir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        return path

    a_tok, b_tok = "alice-" + "a" * 20, "bob-" + "b" * 20
    tokens = secret("tokens", f"alice {a_tok}\nbob {b_tok}\n")
    n, slabs = 8, 8
    out: dict[str, Any] = {}
    with DaemonProcess(tokens_file=tokens, arena_bytes=slabs * BLOCK, max_block_bytes=BLOCK, high_watermark=1.0,
                       low_watermark=1.0) as d, \
            Client(d.address, token_file=secret("a", a_tok)) as alice, \
            Client(d.address, token_file=secret("b", b_tok)) as bob:
        alice.register_namespace("pins/alice")
        bob.register_namespace("pins/bob")
        gpu = torch.randint(0, 256, (n * BLOCK,), dtype=torch.uint8, device=device)
        want = gpu.cpu().numpy()
        copier, mapping, ok_rounds = None, None, []
        for round_ in range(2):
            keys = [f"r{round_}-{i}".encode() for i in range(n)]
            res = alice.reserve("pins/alice", keys, [BLOCK] * n)
            m = alice.acquire_arena(res.incarnation)
            if m is None:
                raise RuntimeError("alice has no arena mapping")
            if copier is None:
                copier, mapping = CudaCopier(m, device), m
            offs = np.uint64(m.address) + np.asarray(res.offsets, dtype=np.uint64)
            g = np.uint64(gpu.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(BLOCK)
            copier.wait(copier.copy(CopyPlan(offs, g, np.full(n, BLOCK, dtype=np.uint64))))
            m.release()
            alice.commit(res)
            got = alice.get_many("pins/alice", keys)
            ok_rounds.append(all(b is not None and np.array_equal(np.frombuffer(b, np.uint8),
                                                                  want[i * BLOCK:(i + 1) * BLOCK])
                                 for i, b in enumerate(got)))
            alice.delete("pins/alice", keys)
            if round_ == 0:   # bob takes every slab, then gives them back empty
                bkeys = [f"b{i}".encode() for i in range(slabs)]
                bob.put_many("pins/bob", bkeys, [b"\x00" * BLOCK] * slabs)
                bob.delete("pins/bob", bkeys)
        assert copier is not None and mapping is not None
        out["tenant_pins_registrations"] = copier.pins.registrations
        out["tenant_pins_slab_binds"] = alice.stats().counters["slab_binds"]
        out["tenant_pins_ok"] = all(ok_rounds) and copier.pins.registrations > n
        copier.close()
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


class _CopySpy:
    """Collects the handles of CudaCopier.copy (a torch.cuda.Event recorded after the gather, its documented
    return) and can turn CudaCopier.fence into a no-op; class-level and undone by `close`, so the worker's own
    copier is the one observed, on its real call path."""

    def __init__(self, cuda: bool) -> None:
        self.handles: list[Any] = []
        self._cls: Any = None
        if cuda:
            from connector.cuda_copy import CudaCopier

            self._cls, self._copy, self._fence = CudaCopier, CudaCopier.copy, CudaCopier.fence
            spy = self

            def copy(copier: Any, plan: Any, after: Any = None) -> Any:
                handle = spy._copy(copier, plan, after)
                spy.handles.append(handle)
                return handle
            CudaCopier.copy = copy  # type: ignore[method-assign]

    def fence(self, on: bool) -> None:
        if self._cls is not None:
            self._cls.fence = self._fence if on else (lambda copier: None)

    def close(self) -> None:
        if self._cls is not None:
            self._cls.copy, self._cls.fence = self._copy, self._fence


def _busy(torch: Any, ms: float) -> Callable[[], None]:
    """A stand-in forward: a kernel that holds the current stream for about `ms` (torch.cuda._sleep spins for
    a number of GPU cycles; calibrated once with CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    n = int(cycles * ms / max(start.elapsed_time(end), 1e-3))
    return lambda: torch.cuda._sleep(n)


def _overwrite_rig(address: str, torch: Any, device: str, keys: int) -> tuple[Any, Any, dict[str, Any], Any]:
    """(worker, link, KV caches, layout spec) of the overwrite check: zeroed bf16 caches for 2 x `keys` keys."""
    from connector.config import ConnectorConfig
    from connector.link import StoreLink
    from connector.namespace import KVLayoutSpec, registration
    from connector.worker import WorkerSide

    config = ConnectorConfig.from_extra({"address": address})
    g = config.resolve_blocks_per_key(2 * LAYERS * BLOCK_TOKENS * KV_HEADS * HEAD_DIM * 2)
    spec = KVLayoutSpec("bench/gpu-overwrite", "bfloat16", BLOCK_TOKENS, LAYERS, KV_HEADS, HEAD_DIM, 0, 1, g)
    num_blocks = 2 * keys * g
    shape = (2, num_blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM)
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(shape, device=device, dtype=torch.bfloat16)
              for i in range(LAYERS)}
    link = StoreLink(address, timeout_s=config.load_timeout_s, namespace_spec=lambda _n: registration(spec))
    worker = WorkerSide(config, spec, link)
    worker.register(caches, num_blocks)
    return worker, link, caches, spec


def overwrite_during_save_check(address: str, torch: Any, device: str, keys: int = KV_KEYS) -> dict[str, Any]:
    """Save `keys` blocks, overwrite them at once (the next step reusing freed blocks), load them back: the
    loaded bytes must be the saved ones. On CUDA the save is issued behind a busy forward, so its gather is
    still pending when the overwrite is enqueued (checked through the gather's event). Also runs on CPU (the
    gather is done when save returns there), which is how the test suite covers this code path."""
    from connector.keys import KeyChain, chain_root
    from connector.plan import LoadJob, SaveJob

    cuda = device.startswith("cuda")
    sync: Callable[[], object] = torch.cuda.synchronize if cuda else (lambda: None)
    forward: Callable[[], object] = _busy(torch, FORWARD_MS) if cuda else (lambda: None)
    worker, link, caches, spec = _overwrite_rig(address, torch, device, keys)
    g = spec.blocks_per_key
    perm = torch.randperm(2 * keys * g, generator=torch.Generator().manual_seed(2)).tolist()
    src_blocks, dst_blocks = perm[:keys * g], perm[keys * g:]
    src_idx = torch.tensor(src_blocks, device=device)
    step_kv = (2, len(src_blocks), BLOCK_TOKENS, KV_HEADS, HEAD_DIM)
    gen = torch.Generator(device=device).manual_seed(3)
    spy = _CopySpy(cuda)
    run = int.from_bytes(os.urandom(4), "little")   # fresh keys per call: a store that has them skips the save
    out: dict[str, Any] = {"overwrite_rounds": 0, "overwrite_mismatched_layers": 0, "overwrite_not_in_flight": 0}
    try:
        for r in range(OVERWRITE_ROUNDS + (1 if cuda else 0)):
            fenced = r < OVERWRITE_ROUNDS
            spy.fence(fenced)
            ks = KeyChain(spec.tokens_per_key, run + r, chain_root(run + r)).extend(
                list(range(keys * spec.tokens_per_key)))
            before = dict(worker.counters.totals)
            sync()
            forward()                                 # the step's forward holds the compute stream ...
            for t in caches.values():                 # ... and writes this step's KV into the blocks
                t[:, src_blocks] = torch.randn(step_kv, generator=gen, device=device).to(torch.bfloat16)
            want = {name: t[:, src_blocks].clone() for name, t in caches.items()}
            spy.handles.clear()
            worker.save([SaveJob(f"overwrite-{r}", None, ks, src_blocks)])   # what wait_for_save runs
            for t in caches.values():                 # the next step reuses the freed blocks at once
                t.index_fill_(1, src_idx, OVERWRITE_VALUE)
            in_flight = (bool(spy.handles) and not spy.handles[-1].query()) if cuda else None
            worker.drain()
            sync()
            saved = worker.counters.totals.get("saved_blocks", 0) - before.get("saved_blocks", 0)
            overwritten = all(bool((t[:, src_blocks] == OVERWRITE_VALUE).all()) for t in caches.values())
            for t in caches.values():
                t[:, dst_blocks] = 0                  # the load must bring every byte back
            worker.start_loads([LoadJob(f"overwrite-load-{r}", None, ks, dst_blocks)])
            worker.drain()
            sync()
            _, recv = worker.finished(set())
            failed = worker.load_errors()
            loaded = worker.counters.totals.get("loaded_blocks", 0) - before.get("loaded_blocks", 0)
            if saved != keys or loaded != keys or failed or recv != {f"overwrite-load-{r}"} or not overwritten:
                raise RuntimeError(f"overwrite round {r}: saved {saved}, loaded {loaded} of {keys} keys, "
                                   f"{len(failed)} failed blocks, received {recv}, overwrite applied {overwritten}")
            bad = sum(int(not torch.equal(caches[name][:, dst_blocks], w)) for name, w in want.items())
            if not fenced:
                out["overwrite_unfenced_mismatched_layers"] = bad
                out["overwrite_check_sensitive"] = bad > 0
                continue
            out["overwrite_rounds"] += 1
            out["overwrite_mismatched_layers"] += bad
            out["overwrite_not_in_flight"] += int(in_flight is False)
    finally:
        spy.close()
        worker.close()
        link.close()
    out["overwrite_gather_in_flight"] = out["overwrite_not_in_flight"] == 0 if cuda else None
    # a round whose gather had already finished when the overwrite was issued tested nothing: not a pass
    out["overwrite_ok"] = out["overwrite_mismatched_layers"] == 0 and out["overwrite_not_in_flight"] == 0
    return out


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
    arena = BLOCK * N_BLOCKS + 3 * KV_KEYS * 2 * MIB * 2 + (OVERWRITE_ROUNDS + 1) * KV_KEYS * 2 * MIB + 256 * MIB
    try:
        with DaemonProcess(arena_bytes=arena, max_block_bytes=BLOCK) as d, Client(d.address) as c:
            if c.mode != "arena":
                raise RuntimeError(f"expected the arena path, got {c.mode}")
            c.register_namespace(NS)
            out.update(dma_check(c, torch, device))
            out.update(save_load_check(d.address, torch, device))
            out.update(overwrite_during_save_check(d.address, torch, device))
        with tempfile.TemporaryDirectory(prefix="kvstore-gpu-pins-") as work:
            out.update(tenant_pins_check(torch, device, work))
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
    ok = (out["dma_bytes_ok"] and out["save_load_ok"] and out["overwrite_ok"] and out["tenant_pins_ok"]
          and not out["e2e"].startswith("FAILED"))
    print("OK: every check passed" if ok else "FAILED: see the tables above")
    print(json.dumps(out, sort_keys=True), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
