"""bench.connector --model gemma3-like's rig: a hybrid (Gemma-3-like) paged KV cache, vLLM's block tables per KV
cache group under its hybrid KV cache manager, and the save, load and limit cases bench/connector_hybrid.py times.

The layout is the one vLLM's hybrid allocator gives a 5:1 sliding:full model: KV cache groups of equal layer
count (one full-attention group, five sliding-window ones), one KV tensor per position in a group, shared by
that layer of every group (the groups' block tables index disjoint blocks of it), vLLM's CPU/FlashAttention
layout (2, num_blocks, block_size, heads, head_dim) bf16. Block tables follow vLLM's rules: each prefill step
allocates the blocks it writes in every group, and before it a sliding group hands back the blocks the next token
no longer attends to (its table then holds the null block, 0; vLLM's remove_skipped_blocks), so the pool is
sized like vLLM's: the prompt for the full group, a chunk plus a window for each sliding one.

Every case checks afterwards that it moved what it claims (counters, the daemon's per-namespace stats, Exists,
sampled blocks compared byte for byte after each load), raising BenchError otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from bench._common import Case
from bench.connector_rig import MIB, BenchError, Request, check
from bench.copy_limit import addrs, native_cases
from kvstore_connector.config import ConnectorConfig
from kvstore_connector.groups import FULL, NULL_BLOCK, GroupKind
from kvstore_connector.link import StoreLink
from kvstore_connector.namespace import KVLayoutSpec, StageLayouts
from kvstore_connector.plan import LoadJob, SaveJob
from kvstore_connector.scheduler import ScheduledRequest, SchedulerSide
from kvstore_connector.worker import WorkerSide
from kvstore.client import Client
from kvstore.testing import DaemonProcess, wait_until

__all__ = ["MODEL", "MODES", "HybridShape", "HybridCache", "Prefill", "prefill_tables", "HybridBench", "BenchError"]

MODEL = "bench/gemma-3-like"
MODES = ("trim", "all")   # connector window_save values, measured in the same run


@dataclass(frozen=True)
class HybridShape:
    """A Gemma-3-like hybrid layout. Default: Gemma 3 4B's attention (4 KV heads x 256, sliding window 1024),
    6 groups x 2 layers (12 layers: 1 full + 5 sliding per 6, Gemma 3's 5:1), vLLM's default block size."""

    groups: int = 6
    layers_per_group: int = 2
    kv_heads: int = 4
    head_dim: int = 256
    block_tokens: int = 16
    window: int = 1024

    @property
    def layers(self) -> int:
        return self.groups * self.layers_per_group

    @property
    def group_block_bytes(self) -> int:
        """One vLLM block of one group: K and V of its layers, bf16."""
        return self.layers_per_group * 2 * self.block_tokens * self.kv_heads * self.head_dim * 2

    def kinds(self) -> list[GroupKind]:
        return [FULL] + [GroupKind("sliding", self.window)] * (self.groups - 1)

    def group_layers(self) -> list[list[str]]:
        """Layer names per group as vLLM groups them: layer i is full attention when (i + 1) % groups == 0
        (Gemma 3: every 6th); each kind's layers in order, cut into groups of layers_per_group."""
        names = [f"model.layers.{i}.self_attn.attn" for i in range(self.layers)]
        full = [n for i, n in enumerate(names) if (i + 1) % self.groups == 0]
        sliding = [n for i, n in enumerate(names) if (i + 1) % self.groups]
        per = self.layers_per_group
        return [full] + [sliding[j * per:(j + 1) * per] for j in range(self.groups - 1)]

    def describe(self) -> str:
        return (f"{self.groups} KV cache groups (1 full + {self.groups - 1} sliding window {self.window}) x "
                f"{self.layers_per_group} layers, {self.layers_per_group} tensors (2, num_blocks, "
                f"{self.block_tokens}, {self.kv_heads}, {self.head_dim}) bf16 each shared by one layer per group")


class HybridCache:
    """The shared per-position KV tensors over one flat, pre-faulted bf16 buffer; every layer name maps to the
    tensor of its position in its group."""

    def __init__(self, shape: HybridShape, num_blocks: int, seed: int = 0) -> None:
        per_tensor = 2 * num_blocks * shape.block_tokens * shape.kv_heads * shape.head_dim
        self.num_blocks = num_blocks
        self.flat = torch.empty(shape.layers_per_group * per_tensor, dtype=torch.bfloat16)
        self.raw = self.flat.view(torch.int16).numpy()  # the same memory (numpy has no bf16)
        rng = np.random.default_rng(seed)
        base = rng.integers(-(1 << 15), 1 << 15, size=min(8 * MIB, self.raw.size), dtype=np.int16)
        for i, start in enumerate(range(0, self.raw.size, base.size)):  # distinct bytes per block
            part = self.raw[start:start + base.size]
            np.bitwise_xor(base[:part.size], np.int16(i), out=part)
        dims = (2, num_blocks, shape.block_tokens, shape.kv_heads, shape.head_dim)
        tensors = [self.flat[j * per_tensor:(j + 1) * per_tensor].view(dims) for j in range(shape.layers_per_group)]
        self.layers = {name: tensors[j] for names in shape.group_layers() for j, name in enumerate(names)}
        self._np = [self.raw[j * per_tensor:(j + 1) * per_tensor].reshape(2, num_blocks, -1)
                    for j in range(shape.layers_per_group)]

    def block(self, b: int) -> bytes:
        """Physical block b of every tensor (what any group holding b stores), K then V per tensor."""
        return b"".join(t[kv, b].tobytes() for t in self._np for kv in range(2))

    def stamp(self, b: int, value: int) -> None:
        for i, t in enumerate(self._np):
            for kv in range(2):
                t[kv, b] = np.int16((value * 131 + i * 2 + kv) % 32749)


@dataclass
class Prefill:
    """One prompt's block tables under vLLM's hybrid manager, step by step."""

    steps: list[tuple[int, list[list[int]]]]   # (tokens scheduled, blocks allocated this step per group)
    tables: list[list[int]]                     # each group's table after the last step (null where handed back)
    peak_blocks: int                            # most pool blocks held at once (the pool's size, without null)


def prefill_tables(kinds: list[GroupKind], block_tokens: int, tokens: int, chunk: int, order: list[int]) -> Prefill:
    """Allocate from ``order`` (pool block ids, popped from the end; handed-back blocks are reused first) as vLLM
    does for a fresh prompt prefilled ``chunk`` tokens a step (0: one step)."""
    free, tables = list(order), [list[int]() for _ in kinds]
    steps: list[tuple[int, list[list[int]]]] = []
    done, peak = 0, 0
    while done < tokens:
        n = min(chunk or tokens, tokens - done)
        need = -(-(done + n) // block_tokens)
        new: list[list[int]] = []
        for kind, table in zip(kinds, tables):
            for i in range(kind.first_needed_block(done, block_tokens)):   # remove_skipped_blocks
                if table[i] != NULL_BLOCK:
                    free.append(table[i])
                    table[i] = NULL_BLOCK
            check(len(free) >= need - len(table), f"block pool of {len(order)} too small: a rig sizing bug")
            add = [free.pop() for _ in range(need - len(table))]
            table += add
            new.append(add)
        peak = max(peak, len(order) - len(free))
        steps.append((n, new))
        done += n
    return Prefill(steps, tables, peak)


@dataclass
class Stored:
    """What the daemon holds between a save and the next one: each group's saved keys, sampled blocks' bytes."""

    keys: list[list[bytes]] = field(default_factory=list)
    expected: dict[int, bytes] = field(default_factory=dict)


class HybridBench:
    """The daemon, the hybrid cache, one scheduler side per window_save mode and one worker side."""

    def __init__(self, d: DaemonProcess, shape: HybridShape, tokens: int, chunk: int, *, copy_threads: int,
                 sample: int, checkpoint: int, seed: int = 0) -> None:
        bt = shape.block_tokens
        check(tokens % bt == 0 and tokens > 0 and chunk % bt == 0,
              f"tokens={tokens}, chunk={chunk}: use multiples of {bt}")
        self.shape, self.tokens, self.chunk, self.kinds = shape, tokens, chunk, shape.kinds()
        self.blocks = tokens // bt
        extra = {"address": d.address, "copy_threads": copy_threads, "window_checkpoint_tokens": checkpoint}
        config = ConnectorConfig.from_extra(extra)
        # as vllm_connector.stage_specs: one blocks_per_key for the stage, from its block bytes over all groups
        g = config.resolve_blocks_per_key(shape.groups * shape.group_block_bytes)
        check(tokens % (g * bt) == 0, f"tokens={tokens}: use a multiple of {g * bt} ({g} blocks per key)")
        base = KVLayoutSpec(MODEL, "bfloat16", bt, shape.layers, shape.kv_heads, shape.head_dim, 0, 1, g)
        self.specs = [replace(base, kind=k, group_index=i, group_count=shape.groups,
                              group_layers=shape.layers_per_group, page_bytes=shape.group_block_bytes)
                      for i, k in enumerate(self.kinds)]
        self.stages = StageLayouts(self.specs)
        self.namespaces = self.stages.names()
        self.blocks_per_key, self.tokens_per_key = g, g * bt
        self.keys = self.blocks // g
        self.key_bytes = g * shape.group_block_bytes
        cb = -(-(chunk or tokens) // bt)
        num_blocks = 1 + self.blocks + (shape.groups - 1) * min(self.blocks, cb + -(-shape.window // bt) + 2)
        self.cache = HybridCache(shape, num_blocks, seed)
        self.client = Client(d.address)
        check(self.client.mode == "arena", f"expected the arena path, got {self.client.mode}")
        self.scheds = {m: SchedulerSide(ConnectorConfig.from_extra({**extra, "window_save": m}), self.specs[0],
                                        self._link(d.address, config), stages=self.stages) for m in MODES}
        self.worker = WorkerSide(config, self.specs[0], self._link(d.address, config), group_specs=self.specs,
                                 group_layers=shape.group_layers())
        self.worker.register(self.cache.layers, num_blocks)
        check(all(self.worker.group_key_bytes(i) == self.key_bytes for i in range(shape.groups)),
              "the worker's key bytes and the layout's disagree")
        order = np.random.default_rng(seed + 1).permutation(np.arange(1, num_blocks)).tolist()  # 0: null block
        self.prefill = prefill_tables(self.kinds, bt, tokens, chunk, order)
        # a hit at the prompt's end: vLLM computes the last token itself; windowed groups get null blocks before
        # the window (what vLLM allocates for a request whose first hit_tokens come from the store)
        self.hit_keys = (tokens - 1) // self.tokens_per_key
        self.hit_tokens = self.hit_keys * self.tokens_per_key
        self.load_tables = [[NULL_BLOCK if i < k.first_needed_block(self.hit_tokens, bt) else b
                             for i, b in enumerate(t)] for k, t in zip(self.kinds, self.prefill.tables)]
        first = [k.first_needed_block(self.hit_tokens, bt) // g for k in self.kinds]
        self.load_keys = [self.hit_keys - f for f in first]
        self.load_bytes = sum(self.load_keys) * self.key_bytes
        loaded = [t[f * g:self.hit_keys * g] for t, f in zip(self.load_tables, first)]
        check(all(b != NULL_BLOCK for t in loaded for b in t), "a loaded block is the null block: a rig bug")
        rng = np.random.default_rng(seed + 2)
        picks = {b for t in loaded for b in (t[0], t[-1])} | set(
            rng.choice(np.concatenate(loaded), size=sample).tolist())
        self.sample = sorted(int(b) for b in picks)
        self.stored = Stored()
        self.n_prompts = 0
        self.stats: dict[str, dict[str, list[int]]] = {}   # per mode: the daemon's blocks and bytes per group
        self.counts: dict[str, float] = {"save_passes": 0, "load_passes": 0, "saved_keys": 0, "loaded_keys": 0,
                                         "sample_blocks_compared": 0}

    def _link(self, address: str, cfg: ConnectorConfig) -> StoreLink:
        return StoreLink(address, timeout_s=cfg.load_timeout_s, copy_threads=cfg.copy_threads,
                         namespace_spec=self.stages.registration)

    def close(self) -> None:
        self.worker.close()
        self.worker.link.close()
        for s in self.scheds.values():
            s.link.close()
        self.client.close()

    def _request(self) -> Request:
        self.n_prompts += 1                     # fresh keys per prompt
        return Request(f"bench-{self.n_prompts}", self._prompt_tokens())

    def _prompt_tokens(self) -> list[int]:
        """The current prompt's tokens (a load hits the last one saved)."""
        return [self.n_prompts] + [(7 * i) % 32000 for i in range(1, self.tokens)]

    @staticmethod
    def _group_keys(steps: list[list[SaveJob]], groups: int, g: int) -> list[list[bytes]]:
        """Each group's keys the jobs save: those whose blocks the group gives in full (the others are -1)."""
        keys: list[list[bytes]] = [[] for _ in range(groups)]
        for job in (j for jobs in steps for j in jobs):
            for gi, blocks in enumerate(job.block_ids):
                keys[gi] += [k for i, k in enumerate(job.keys) if min(blocks[i * g:(i + 1) * g]) >= 0]
        return keys

    def planned_keys(self, mode: str) -> list[int]:
        """Keys per group one save of a prompt stores with window_save ``mode`` (plans only, nothing saved)."""
        return [len(k) for k in self._group_keys(self.prompt_steps(mode), len(self.kinds), self.blocks_per_key)]

    def prompt_steps(self, mode: str) -> list[list[SaveJob]]:
        """The SaveJobs the scheduler side (window_save ``mode``) issues, step by step, for a fresh prompt."""
        sched, req = self.scheds[mode], self._request()
        sched.track(req)
        steps = []
        for i, (n, new) in enumerate(self.prefill.steps):
            steps.append(sched.build([ScheduledRequest(req.request_id, new, i == 0, n)]).saves)
            req.num_computed_tokens += n
        sched.build([], finished_req_ids={req.request_id})
        return steps

    def forget_stored(self) -> None:
        """Delete what the daemon holds (after the loads' leases are back), so the next save copies every key."""
        if self.stored.keys:
            wait_until(lambda: self.client.stats().leases_active == 0, what="the loads' leases to be released")
            for ns, keys in zip(self.namespaces, self.stored.keys):
                n = self.client.delete(ns, keys)
                check(n == len(keys), f"deleted {n} of {len(keys)} stored keys of {ns}")
            self.stored = Stored()

    def _daemon_groups(self) -> dict[str, list[int]]:
        by_name = {s.name: s for s in self.client.stats().namespaces}
        got = [by_name.get(ns) for ns in self.namespaces]
        return {"blocks": [s.blocks if s else 0 for s in got], "bytes": [s.bytes if s else 0 for s in got]}

    # -- cases -------------------------------------------------------------------------------------------
    def save_case(self, mode: str, tick: Callable[[str], None]) -> Case:
        w, label = self.worker, f"save window_save={mode}"

        def setup() -> tuple[list[list[SaveJob]], dict[str, float]]:
            tick(label)
            self.forget_stored()
            steps = self.prompt_steps(mode)
            for b in self.sample:
                self.cache.stamp(b, self.n_prompts)
            return steps, dict(w.counters.totals)

        def fn(arg: tuple[list[list[SaveJob]], dict[str, float]]) -> None:
            for jobs in arg[0]:
                w.save(jobs)                    # what wait_for_save runs each step
            w.drain()

        def teardown(arg: tuple[list[list[SaveJob]], dict[str, float]]) -> None:
            steps, before = arg
            keys = self._group_keys(steps, len(self.kinds), self.blocks_per_key)
            n = sum(len(k) for k in keys)
            got = {k: w.counters.totals.get(k, 0) - before.get(k, 0)
                   for k in ("saved_blocks", "saved_bytes", "save_skipped_blocks", "save_failures")}
            check(len(keys[0]) == self.keys, f"{label}: the full group saves {len(keys[0])} keys, not {self.keys}")
            check(got == {"saved_blocks": n, "saved_bytes": n * self.key_bytes, "save_skipped_blocks": 0,
                          "save_failures": 0}, f"{label}: counters {got}, expected {n} keys saved")
            daemon = self._daemon_groups()
            want = {"blocks": [len(k) for k in keys], "bytes": [len(k) * self.key_bytes for k in keys]}
            check(daemon == want, f"{label}: the daemon holds {daemon} per group, expected {want}")
            check(self.stats.setdefault(mode, daemon) == daemon, f"{label}: stored {daemon}, an earlier pass "
                  f"{self.stats[mode]}")
            check(all(all(self.client.exists(ns, k)) for ns, k in zip(self.namespaces, keys)),
                  f"{label}: not every saved key is in the store")
            self.stored = Stored(keys, {b: self.cache.block(b) for b in self.sample})
            self.counts["save_passes"] += 1
            self.counts["saved_keys"] += n
        return Case(fn, setup, teardown)

    def load_case(self, mode: str, tick: Callable[[str], None]) -> Case:
        """The load of a hit at the prompt's end: the scheduler's lookup (untimed) and its LoadJob, one block
        list per group (windowed groups: the window only), loaded by the worker (timed)."""
        w, sched, label = self.worker, self.scheds[mode], f"load window_save={mode}"

        def setup() -> tuple[LoadJob, dict[str, float]]:
            tick(label)
            check(bool(self.stored.keys), "a load needs a saved prompt: run a save case first")
            req = Request(f"load-{self.n_prompts}", self._prompt_tokens())
            sched.track(req)
            hit, _ = sched.num_new_matched_tokens(req, 0)
            check(hit == self.hit_tokens, f"{label}: the scheduler offers {hit} tokens, expected {self.hit_tokens}")
            sched.after_alloc(req, [list(t) for t in self.load_tables], hit)
            (job,) = sched.build([]).loads
            sched.request_finished(req)
            per_group = [sum(1 for i in range(len(job.keys)) if max(b[i * self.blocks_per_key:
                                                                      (i + 1) * self.blocks_per_key]) >= 0)
                         for b in job.block_ids]
            check(per_group == self.load_keys, f"{label}: the LoadJob fills {per_group} keys per group, "
                  f"expected {self.load_keys}")
            for b in self.sample:
                self.cache.stamp(b, 0)          # overwrite: the load must bring the saved bytes back
            return job, dict(w.counters.totals)

        def fn(arg: tuple[LoadJob, dict[str, float]]) -> None:
            w.start_loads([arg[0]])             # a RAM hit loads synchronously: start_load_kv waits for it
            w.drain()

        def teardown(arg: tuple[LoadJob, dict[str, float]]) -> None:
            _, before = arg
            failed = w.load_errors()
            got = {k: w.counters.totals.get(k, 0) - before.get(k, 0)
                   for k in ("loaded_blocks", "loaded_bytes", "load_failed_blocks")}
            n = sum(self.load_keys)
            check(not failed and got == {"loaded_blocks": n, "loaded_bytes": self.load_bytes,
                                         "load_failed_blocks": 0},
                  f"{label}: counters {got}, {len(failed)} failed blocks; expected {n} keys loaded")
            bad = [b for b in self.sample if self.cache.block(b) != self.stored.expected[b]]
            check(not bad, f"{label}: blocks {bad} differ from the bytes saved")
            self.counts["load_passes"] += 1
            self.counts["loaded_keys"] += n
            self.counts["sample_blocks_compared"] += len(self.sample)
        return Case(fn, setup, teardown)

    def limit_cases(self, sizes: dict[str, int], tick: Callable[[str], None]) -> dict[str, Case]:
        """f"limit_{name}{t}": kvstore's native copy of ``sizes[name]`` bytes as one range between two pre-faulted
        buffers, at 1 and 2 threads (the bytes a save or load moves, so each product has its own limit)."""
        top = max(sizes.values())
        src, dst = np.empty(top, np.uint8), np.empty(top, np.uint8)
        src.fill(7)
        dst.fill(0)                             # pre-fault both
        self._limit_buffers = (src, dst)
        out: dict[str, Case] = {}
        for name, n in sizes.items():
            triple = addrs([dst[:n]], [src[:n]])

            def make(triple: Any = triple, name: str = name) -> Any:
                tick(f"limit: native copy ({name})")
                return triple
            out.update(native_cases(make, prefix=f"limit_{name}"))
        return out
