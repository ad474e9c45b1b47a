"""The hybrid-model check of bench.gpu_check: the worker side's save and load of two KV cache groups (full
attention + sliding window) laid out the way vLLM 0.33 gives a hybrid model's KV cache to a GPU worker.

The layout: ONE backing allocation; each position in a group (layers_per_group of them) is a slice of it,
shared by that layer of every group (vLLM's hybrid allocator: layer i of the full group and layer i of the
sliding group are the same bytes, and the groups' block tables index disjoint blocks of it); each slice is seen
through vLLM 0.33's default GPU layout LBNHC: a dense (num_blocks, block_size, 2, heads x head_dim) page store
permuted to per-layer views (num_blocks, 2, block_size, heads x head_dim), bf16. The jobs are the scheduler's:
one block list per group, the sliding group's list -1 outside what its window trimming stores (a save) or what
vLLM keeps at the hit (a load). The window (HYBRID_WINDOW tokens) is not a multiple of a stored block, so the
load's first sliding key holds a -1 block inside a key it loads.

Each round: fresh bytes in the whole allocation, save, every group's keys checked in the daemon (the sliding
group holds exactly its window), the whole allocation overwritten with a sentinel, load into other blocks, then
on the device, page by page (one layer's one vLLM block): every destination holds the bytes saved from its
source, and every other page (the -1 blocks, the sources, the spare blocks, the other group's blocks) still
holds the sentinel. The first round is a warm-up; GB/s is the median of the others. Runs on CUDA tensors
(CudaCopier) and on CPU tensors (the CPU copier: tests/test_bench_gpu_check.py).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from bench._common import gbs
from bench.gpu_checks import BLOCK_TOKENS, HEAD_DIM, KV_HEADS

__all__ = ["HYBRID_KEYS", "HYBRID_WINDOW", "HYBRID_ROUNDS", "HYBRID_LAYERS_PER_GROUP", "HYBRID_LAYOUT",
           "SENTINEL", "HybridPlan", "hybrid_plan", "hybrid_arena_bytes", "hybrid_save_load_check"]

HYBRID_KEYS = 512               # stored blocks of the prompt (full group): 512 x 256 KiB = 128 MiB a pass
HYBRID_WINDOW = 1000            # sliding window in tokens: not a multiple of a stored block (see the docstring)
HYBRID_ROUNDS = 4               # 1 warm-up + 3 timed
HYBRID_LAYERS_PER_GROUP = 2     # positions per group: 4 layers, 2 groups, 2 slices of the one allocation
HYBRID_LAYOUT = "LBNHC"
HYBRID_SPARE = 8                # blocks no job names: they must keep the sentinel
SENTINEL = -5.0                 # bf16-exact; what every page holds before a load
MODEL = "bench/gpu-hybrid"
LAYER_PAGE = 2 * BLOCK_TOKENS * KV_HEADS * HEAD_DIM * 2   # one layer's K and V of one vLLM block, bf16


@dataclass(frozen=True)
class HybridPlan:
    """The block lists of one round's SaveJob and LoadJob (per group, flat, blocks_per_key per key) and the
    (destination, source) block pairs a correct load fills."""

    blocks_per_key: int
    num_blocks: int
    save_ids: list[list[int]]
    load_ids: list[list[int]]
    pairs: list[list[tuple[int, int]]]
    saved_keys: list[list[int]]    # key indexes each group stores
    loaded_keys: list[list[int]]   # key indexes each group loads (a block to fill)


def _kinds(window: int) -> list[Any]:
    from kvstore_connector.groups import FULL, GroupKind

    return [FULL, GroupKind("sliding", window)]


def _blocks_per_key(extra: dict[str, Any]) -> int:
    """As vllm_connector.stage_specs resolves it for a hybrid model: the stage's layers x one layer's page."""
    from kvstore_connector.config import ConnectorConfig

    return ConnectorConfig.from_extra(extra).resolve_blocks_per_key(2 * HYBRID_LAYERS_PER_GROUP * LAYER_PAGE)


def hybrid_plan(keys: int, window: int, blocks_per_key: int, seed: int = 0) -> HybridPlan:
    """A prompt of ``keys`` stored blocks plus one token: the full group saves every key, the sliding group the
    keys its window before the prompt's end touches (kvstore_connector/groups.py's trimming, no checkpoints); the hit of
    ``keys`` keys loads every full key and, in the sliding group, only the blocks vLLM keeps there. Block ids:
    a seeded permutation of 1..num_blocks-1 (0 is vLLM's null block), disjoint between groups and jobs."""
    import numpy as np

    from kvstore_connector.groups import save_points, saved_in_window

    g, bs = blocks_per_key, BLOCK_TOKENS
    tpk = g * bs
    full, sliding = _kinds(window)
    points = save_points(keys * tpk + 1, tpk, 0)
    saved = [list(range(keys)), [k for k in range(keys) if saved_in_window(sliding, k, tokens_per_key=tpk,
                                                                           block_size=bs, save_points=points)]]
    first = sliding.first_needed_block(keys * tpk, bs)          # vLLM keeps blocks first.. of the sliding group
    if not saved[1] or first < saved[1][0] * g:
        raise RuntimeError(f"window {window}: the saved window {saved[1]} does not cover the loaded one (block "
                           f"{first} on): a rig bug")
    save_mask = [list(range(keys * g)), [i for k in saved[1] for i in range(k * g, (k + 1) * g)]]
    load_mask = [list(range(keys * g)), list(range(first, keys * g))]
    n = sum(len(m) for m in save_mask + load_mask)
    num_blocks = 1 + n + HYBRID_SPARE
    perm = (1 + np.random.default_rng(seed).permutation(num_blocks - 1)).tolist()
    take = iter(perm)
    src = [{i: next(take) for i in m} for m in save_mask]
    dst = [{i: next(take) for i in m} for m in load_mask]
    save_ids = [[s.get(i, -1) for i in range(keys * g)] for s in src]
    load_ids = [[d.get(i, -1) for i in range(keys * g)] for d in dst]
    pairs = [[(d[i], s[i]) for i in sorted(d)] for s, d in zip(src, dst)]
    loaded = [sorted({i // g for i in d}) for d in dst]
    return HybridPlan(g, num_blocks, save_ids, load_ids, pairs, saved, loaded)


def hybrid_arena_bytes(keys: int = HYBRID_KEYS, window: int = HYBRID_WINDOW) -> int:
    """Arena bytes every round's fresh keys take (nothing is deleted between rounds)."""
    g = _blocks_per_key({})
    plan = hybrid_plan(keys, window, g)
    key_bytes = g * HYBRID_LAYERS_PER_GROUP * LAYER_PAGE
    return HYBRID_ROUNDS * sum(len(k) for k in plan.saved_keys) * key_bytes


class _Cache:
    """The one backing allocation, its LBNHC per-layer views and each group's layer names."""

    def __init__(self, torch: Any, device: str, num_blocks: int) -> None:
        p, c = HYBRID_LAYERS_PER_GROUP, KV_HEADS * HEAD_DIM
        self.page_elems = BLOCK_TOKENS * 2 * c
        self.backing = torch.empty(p * num_blocks * self.page_elems, dtype=torch.bfloat16, device=device)
        self.pages = self.backing.view(torch.int16).view(p, num_blocks, self.page_elems)   # bitwise compares
        views = [self.backing[j * num_blocks * self.page_elems:(j + 1) * num_blocks * self.page_elems]
                 .view(num_blocks, BLOCK_TOKENS, 2, c).permute(0, 2, 1, 3) for j in range(p)]
        if views[0].is_contiguous():
            raise RuntimeError("the LBNHC views came out contiguous: a rig bug (the check would test LBHNC)")
        # layers 0, 2, .. full attention, 1, 3, .. sliding (Gemma 2's alternation); layer i of either group: view i
        self.group_layers = [[f"model.layers.{2 * j + gi}.self_attn.attn" for j in range(p)] for gi in range(2)]
        self.layers = {name: views[j] for names in self.group_layers for j, name in enumerate(names)}


def _worker(address: str, cache: _Cache, num_blocks: int, g: int, window: int) -> tuple[Any, Any, list[Any]]:
    """(worker, link, group specs) of the two groups, as the connector builds them for a hybrid model."""
    from kvstore_connector.config import ConnectorConfig
    from kvstore_connector.link import StoreLink
    from kvstore_connector.namespace import KVLayoutSpec, StageLayouts
    from kvstore_connector.worker import WorkerSide

    config = ConnectorConfig.from_extra({"address": address})
    p = HYBRID_LAYERS_PER_GROUP
    base = KVLayoutSpec(MODEL, "bfloat16", BLOCK_TOKENS, 2 * p, KV_HEADS, HEAD_DIM, 0, 1, g, kv_layout=HYBRID_LAYOUT)
    specs = [replace(base, kind=k, group_index=i, group_count=2, group_layers=p, page_bytes=p * LAYER_PAGE)
             for i, k in enumerate(_kinds(window))]
    stages = StageLayouts(specs)
    link = StoreLink(address, timeout_s=config.load_timeout_s, namespace_spec=stages.registration)
    worker = WorkerSide(config, specs[0], link, group_specs=specs, group_layers=cache.group_layers)
    try:
        worker.register(cache.layers, num_blocks)
        sizes = [lay.block_bytes for lay in worker.layouts]
        if sizes != [s.block_bytes for s in specs] or [lay.num_pieces for lay in worker.layouts] != [p, p]:
            raise RuntimeError(f"the worker's layouts: {sizes} B and {[x.num_pieces for x in worker.layouts]} "
                               f"pieces per block; expected {specs[0].block_bytes} B in {p} pieces (one page a layer)")
    except BaseException:
        worker.close()
        link.close()
        raise
    return worker, link, specs


def _page_checks(torch: Any, cache: _Cache, want: Any, plan: HybridPlan) -> tuple[int, int]:
    """(destination pages whose bytes differ from the saved ones, other pages that lost the sentinel)."""
    dst = [d for pairs in plan.pairs for d, _ in pairs]
    dev = cache.backing.device
    got = cache.pages[:, torch.tensor(dst, device=dev)]
    mismatched = int((got != want).any(dim=2).sum())
    others = sorted(set(range(plan.num_blocks)) - set(dst))
    bits = torch.tensor(SENTINEL, dtype=torch.bfloat16).view(torch.int16).item()
    touched = int((cache.pages[:, torch.tensor(others, device=dev)] != bits).any(dim=2).sum())
    return mismatched, touched


def _held(c: Any, ns: str, keys: list[bytes]) -> list[bool]:
    """Exists of `keys` in `ns`; none when no save ever registered the namespace (a group saved under another
    group's name: the check that catches that runs first in a fresh daemon too)."""
    from kvstore.errors import UnknownNamespaceError
    try:
        return list(c.exists(ns, keys))
    except UnknownNamespaceError:
        return [False] * len(keys)


def hybrid_save_load_check(address: str, torch: Any, device: str, keys: int = HYBRID_KEYS,
                           window: int = HYBRID_WINDOW) -> dict[str, Any]:
    """Save a hybrid model's two groups from the one aliased LBNHC allocation, load them into other blocks, and
    check every page on the device (module docstring). Counts that are off (keys saved or loaded, bytes, failed
    loads, what the daemon holds) make ``hybrid_ok`` false, like differing pages; nothing here raises for them."""
    from kvstore_connector.keys import KeyChain, chain_root
    from kvstore_connector.namespace import namespace_for
    from kvstore_connector.plan import LoadJob, SaveJob
    from kvstore.client import Client

    cuda = device.startswith("cuda")
    sync: Callable[[], object] = torch.cuda.synchronize if cuda else (lambda: None)
    g = _blocks_per_key({"address": address})
    plan = hybrid_plan(keys, window, g)
    cache = _Cache(torch, device, plan.num_blocks)
    worker, link, specs = _worker(address, cache, plan.num_blocks, g, window)
    key_bytes = g * HYBRID_LAYERS_PER_GROUP * LAYER_PAGE
    page_bytes = HYBRID_LAYERS_PER_GROUP * LAYER_PAGE              # one vLLM block of one group
    n_saved = sum(len(k) for k in plan.saved_keys)
    n_loaded = sum(len(k) for k in plan.loaded_keys)
    want_counts = {"saved_blocks": n_saved, "saved_bytes": n_saved * key_bytes, "save_failures": 0,
                   "save_skipped_blocks": 0, "loaded_blocks": n_loaded,
                   "loaded_bytes": sum(len(p) for p in plan.pairs) * page_bytes, "load_failed_blocks": 0}
    src = torch.tensor([s for pairs in plan.pairs for _, s in pairs], device=device)
    gen = torch.Generator(device=device).manual_seed(4)
    run = int.from_bytes(os.urandom(4), "little")   # fresh keys per call: a store that has them skips the save
    names = [namespace_for(s) for s in specs]
    out: dict[str, Any] = {"hybrid_mismatched_pages": 0, "hybrid_touched_pages": 0, "hybrid_bad_counts": 0,
                           "hybrid_bad_store": 0, "hybrid_bad_loads": 0}
    save_s: list[float] = []
    load_s: list[float] = []
    try:
        with Client(address) as c:
            for r in range(HYBRID_ROUNDS):
                ks = KeyChain(g * BLOCK_TOKENS, run + r, chain_root(run + r)).extend(
                    list(range(keys * g * BLOCK_TOKENS)))
                before = dict(worker.counters.totals)
                cache.backing.copy_(torch.randn(cache.backing.shape, generator=gen, device=device))
                sync()
                t0 = time.perf_counter()
                worker.save([SaveJob(f"hybrid-save-{r}", None, ks, plan.save_ids)])
                worker.drain()
                save_s.append(time.perf_counter() - t0)
                held = [_held(c, ns, ks) for ns in names]
                out["hybrid_bad_store"] += int(held != [[i in set(k) for i in range(keys)] for k in plan.saved_keys])
                want = cache.pages[:, src].clone()
                cache.backing.fill_(SENTINEL)                 # the load must bring back every byte it names
                sync()
                t0 = time.perf_counter()
                worker.start_loads([LoadJob(f"hybrid-load-{r}", None, ks, plan.load_ids)])
                worker.drain()
                sync()
                load_s.append(time.perf_counter() - t0)
                _, recv, failed = worker.transfer_results(set())
                bad_load = recv != {f"hybrid-load-{r}"} or bool(failed) or bool(worker.load_errors())
                out["hybrid_bad_loads"] += int(bad_load)
                got = {k: worker.counters.totals.get(k, 0) - before.get(k, 0) for k in want_counts}
                out["hybrid_bad_counts"] += int(got != want_counts)
                if got != want_counts:
                    out.setdefault("hybrid_counts_seen", got)
                mismatched, touched = _page_checks(torch, cache, want, plan)
                out["hybrid_mismatched_pages"] += mismatched
                out["hybrid_touched_pages"] += touched
    finally:
        worker.close()
        link.close()
    out.update({"hybrid_rounds": HYBRID_ROUNDS, "hybrid_layout": HYBRID_LAYOUT, "hybrid_keys": keys,
                "hybrid_window": window, "hybrid_blocks_per_key": g, "hybrid_key_bytes": key_bytes,
                "hybrid_saved_keys": [len(k) for k in plan.saved_keys],
                "hybrid_loaded_keys": [len(k) for k in plan.loaded_keys],
                "hybrid_loaded_blocks": [len(p) for p in plan.pairs],
                "hybrid_save_bytes": want_counts["saved_bytes"], "hybrid_load_bytes": want_counts["loaded_bytes"],
                "hybrid_save_gbs": gbs(want_counts["saved_bytes"], statistics.median(save_s[1:] or save_s)),
                "hybrid_load_gbs": gbs(want_counts["loaded_bytes"], statistics.median(load_s[1:] or load_s))})
    out["hybrid_ok"] = not any(out[k] for k in ("hybrid_mismatched_pages", "hybrid_touched_pages",
                                                "hybrid_bad_counts", "hybrid_bad_store", "hybrid_bad_loads"))
    return out
