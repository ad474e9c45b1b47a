"""The transfer checks of bench.gpu_check (DMA through the registered arena, per-tenant pins, WorkerSide save +
load with model-shaped CUDA KV) and the shapes every GPU check shares.

Split out of bench/gpu_check.py (which runs them and prints the tables) so each file holds one concern; the
overwrite-during-save check lives in bench/gpu_overwrite.py. Every function here needs CUDA; the module
imports without it (torch and the connector's CUDA parts are imported or passed in by the caller).
"""

from __future__ import annotations

import ctypes
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench._common import gbs

__all__ = ["MIB", "BLOCK", "N_BLOCKS", "LAYERS", "KV_HEADS", "HEAD_DIM", "BLOCK_TOKENS", "KV_KEYS", "REPS", "NS",
           "dma_check", "tenant_pins_check", "save_load_check"]

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
    from kvstore_connector.cuda_copy import CudaCopier
    from kvstore_connector.layout import CopyPlan

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
    (kvstore_connector/pinning.py). Alice writes blocks from the GPU, deletes them; bob takes every slab (they leave
    alice's file and are punched out of it); bob deletes his; alice writes again into slabs that came back with
    new pages. Her copier must re-pin them (a stale pin would DMA into orphaned pages and the daemon would see
    zeros): every block read back through the daemon must equal the GPU bytes."""
    from kvstore_connector.cuda_copy import CudaCopier
    from kvstore_connector.layout import CopyPlan
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
    from kvstore_connector.config import ConnectorConfig
    from kvstore_connector.keys import KeyChain, chain_root
    from kvstore_connector.link import StoreLink
    from kvstore_connector.namespace import KVLayoutSpec, registration
    from kvstore_connector.plan import LoadJob, SaveJob
    from kvstore_connector.worker import WorkerSide

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
            worker.save([SaveJob(f"save-{r}", None, keys, [src_blocks])])   # the kernel runs after the "forward"
            worker.drain()
            save_s.append(time.perf_counter() - t0)
            saved = worker.counters.totals.get("saved_blocks", 0) - before.get("saved_blocks", 0)
            for t in caches.values():
                t[:, dst_blocks] = 0                         # the load must bring every byte back
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            worker.start_loads([LoadJob(f"load-{r}", None, keys, [dst_blocks])])
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
