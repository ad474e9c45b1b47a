"""The overwrite-during-save check of bench.gpu_check: a save's gather must read the KV blocks as they were
when the save was issued, even when the next step overwrites them at once (CudaCopier.fence orders the compute
stream after the gather).

On CUDA the save is issued behind a busy stand-in forward, so its gather is still in flight when the overwrite
is enqueued; `_CopySpy` observes the worker's own CudaCopier (and can disable the fence, to show the check
would catch a missing one). The same code runs on CPU tensors in tests/test_bench_gpu_check.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from bench.gpu_checks import BLOCK_TOKENS, HEAD_DIM, KV_HEADS, KV_KEYS, LAYERS

__all__ = ["OVERWRITE_ROUNDS", "FORWARD_MS", "OVERWRITE_VALUE", "overwrite_during_save_check"]

OVERWRITE_ROUNDS = 2            # fenced rounds of the overwrite check (+ 1 without the fence, on CUDA)
FORWARD_MS = 50                 # how long the stand-in forward holds the compute stream before each save
OVERWRITE_VALUE = 7.0           # what the "next step" writes into the saved blocks (bf16-exact, never random)


class _CopySpy:
    """Collects the handles of CudaCopier.copy (a torch.cuda.Event recorded after the gather, its documented
    return) and can turn CudaCopier.fence into a no-op; class-level and undone by `close`, so the worker's own
    copier is the one observed, on its real call path."""

    def __init__(self, cuda: bool) -> None:
        self.handles: list[Any] = []
        self._cls: Any = None
        if cuda:
            from kvstore_connector.cuda_copy import CudaCopier

            self._cls, self._copy, self._fence = CudaCopier, CudaCopier.copy, CudaCopier.fence
            spy = self

            def copy(copier: Any, plan: Any, after: Any = None) -> Any:
                handle = spy._copy(copier, plan, after)
                spy.handles.append(handle)
                return handle
            CudaCopier.copy = copy  # type: ignore[method-assign, assignment]  # a spy for this run; close() restores it

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
    from kvstore_connector.config import ConnectorConfig
    from kvstore_connector.link import StoreLink
    from kvstore_connector.namespace import KVLayoutSpec, registration
    from kvstore_connector.worker import WorkerSide

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
    from kvstore_connector.keys import KeyChain, chain_root
    from kvstore_connector.plan import LoadJob, SaveJob

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
            worker.save([SaveJob(f"overwrite-{r}", None, ks, [src_blocks])])   # what wait_for_save runs
            for t in caches.values():                 # the next step reuses the freed blocks at once
                t.index_fill_(1, src_idx, OVERWRITE_VALUE)
            in_flight = (bool(spy.handles) and not spy.handles[-1].query()) if cuda else None
            worker.drain()
            sync()
            saved = worker.counters.totals.get("saved_blocks", 0) - before.get("saved_blocks", 0)
            overwritten = all(bool((t[:, src_blocks] == OVERWRITE_VALUE).all()) for t in caches.values())
            for t in caches.values():
                t[:, dst_blocks] = 0                  # the load must bring every byte back
            worker.start_loads([LoadJob(f"overwrite-load-{r}", None, ks, [dst_blocks])])
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
