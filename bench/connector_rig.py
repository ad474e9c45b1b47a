"""bench.connector's rig: a vLLM-shaped paged KV cache, the scheduler side and one worker side per thread count
over one daemon, and the save, load and limit cases the benchmark times.

Why a module of its own: bench/connector.py is the run (plan, round-robin, summary, tables); this is what it
runs, and each case checks afterwards that it moved every byte it claims (counters, Exists, sampled blocks
compared), raising BenchError otherwise: a benchmark of nothing must fail, not report a number.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from bench._common import Case
from bench.copy_limit import addrs, native_cases
from kvstore_connector.config import ConnectorConfig
from kvstore_connector.link import StoreLink
from kvstore_connector.namespace import KVLayoutSpec, namespace_for, registration
from kvstore_connector.plan import LoadJob, SaveJob
from kvstore_connector.scheduler import ScheduledRequest, SchedulerSide
from kvstore_connector.worker import WorkerSide
from kvstore.client import Client
from kvstore.testing import DaemonProcess, wait_until

__all__ = ["MIB", "LAYERS", "KV_HEADS", "HEAD_DIM", "BLOCK_TOKENS", "MODEL", "BenchError", "check", "PagedCache",
           "Request", "Stored", "Bench"]

MIB = 1 << 20
LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 32, 8, 128, 16      # Llama-3-8B-shaped, vLLM's default block size
MODEL = "bench/llama-3-8b-shaped"


class BenchError(RuntimeError):
    """The run did not move what it claims: a benchmark of nothing must fail, not report a number."""


def check(ok: bool, what: str) -> None:
    if not ok:
        raise BenchError(what)


class PagedCache:
    """vLLM's per-layer KV tensors over one flat, pre-faulted bf16 buffer (also the limit copy's source)."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        per_layer = 2 * num_blocks * BLOCK_TOKENS * KV_HEADS * HEAD_DIM
        self.num_blocks = num_blocks
        self.flat = torch.empty(LAYERS * per_layer, dtype=torch.bfloat16)
        self.raw = self.flat.view(torch.int16).numpy()  # the same memory (numpy has no bf16)
        rng = np.random.default_rng(seed)
        base = rng.integers(-(1 << 15), 1 << 15, size=min(8 * MIB, self.raw.size), dtype=np.int16)
        for i, start in enumerate(range(0, self.raw.size, base.size)):  # distinct bytes per block, ~1 s per 4 GiB
            part = self.raw[start:start + base.size]
            np.bitwise_xor(base[:part.size], np.int16(i), out=part)
        shape = (2, num_blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM)
        self.layers = {f"model.layers.{i}.self_attn.attn": self.flat[i * per_layer:(i + 1) * per_layer].view(shape)
                       for i in range(LAYERS)}
        self._np = [self.raw[i * per_layer:(i + 1) * per_layer].reshape(2, num_blocks, -1) for i in range(LAYERS)]
        self.block_bytes = self.raw.nbytes // num_blocks

    def block(self, b: int) -> bytes:
        """vLLM block b in the connector's order: layer by layer, K then V."""
        return b"".join(t[kv, b].tobytes() for t in self._np for kv in range(2))

    def stamp(self, b: int, value: int) -> None:
        for i, t in enumerate(self._np):
            for kv in range(2):
                t[kv, b] = np.int16((value * 131 + i * 2 + kv) % 32749)


@dataclass
class Request:
    """The attributes of vLLM's Request that SchedulerSide reads."""

    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids


@dataclass
class Stored:
    """The one prompt the daemon holds between a save and the next one (the arena holds one prompt)."""

    keys: list[bytes] = field(default_factory=list)
    expected: dict[int, bytes] = field(default_factory=dict)


class Bench:
    """Everything one run shares: the daemon, the KV cache, the scheduler side, one worker side per thread count."""

    def __init__(self, d: DaemonProcess, tokens: int, threads: Sequence[int], sample: int, seed: int = 0) -> None:
        check(tokens % BLOCK_TOKENS == 0 and tokens > 0, f"tokens={tokens}: use a multiple of {BLOCK_TOKENS}")
        self.tokens, self.blocks = tokens, tokens // BLOCK_TOKENS
        self.cache = PagedCache(self.blocks, seed)
        config = ConnectorConfig.from_extra({"address": d.address})
        g = config.resolve_blocks_per_key(self.cache.block_bytes)
        self.spec = KVLayoutSpec(MODEL, "bfloat16", BLOCK_TOKENS, LAYERS, KV_HEADS, HEAD_DIM, 0, 1, g)
        check(self.spec.block_bytes == self.cache.block_bytes, "the layout spec and the cache disagree")
        self.keys = self.blocks // g
        self.nbytes = self.keys * g * self.cache.block_bytes
        self.ns = namespace_for(self.spec)
        self.client = Client(d.address)
        check(self.client.mode == "arena", f"expected the arena path, got {self.client.mode}")
        self.sched = SchedulerSide(config, self.spec, self._link(d.address, config))
        self.workers: dict[int, WorkerSide] = {}
        for t in threads:
            cfg = ConnectorConfig.from_extra({"address": d.address, "copy_threads": t})
            w = WorkerSide(cfg, self.spec, self._link(d.address, cfg))
            w.register(self.cache.layers, self.blocks)
            self.workers[t] = w
        rng = np.random.default_rng(seed + 1)
        self.table = rng.permutation(self.blocks).tolist()        # a busy server's scattered block table
        picks = {self.table[0], self.table[-1], *rng.choice(self.blocks, size=min(sample, self.blocks)).tolist()}
        self.sample = sorted(int(b) for b in picks)
        self.stored = Stored()
        self.n_prompts = 0
        self.counts: dict[str, float] = {"save_passes": 0, "load_passes": 0, "saved_blocks": 0, "loaded_blocks": 0,
                       "sample_blocks_compared": 0}
        self.step_seconds: list[float] = []

    def _link(self, address: str, cfg: ConnectorConfig) -> StoreLink:
        return StoreLink(address, timeout_s=cfg.load_timeout_s, copy_threads=cfg.copy_threads,
                         namespace_spec=lambda _n: registration(self.spec))

    def close(self) -> None:
        for w in self.workers.values():
            w.close()
            w.link.close()
        self.sched.link.close()
        self.client.close()

    # -- prompts -----------------------------------------------------------------------------------------
    def prompt_steps(self, chunk: int) -> list[list[SaveJob]]:
        """The SaveJobs vLLM's scheduler side issues, step by step, for a fresh prompt prefilled in chunks."""
        self.n_prompts += 1
        rid = f"bench-{self.n_prompts}"
        req = Request(rid, [self.n_prompts] + [(7 * i) % 32000 for i in range(1, self.tokens)])  # fresh keys
        self.sched.track(req)
        steps: list[list[SaveJob]] = []
        done, have = 0, 0
        while done < self.tokens:
            n = min(chunk or self.tokens, self.tokens - done)
            need = -(-(done + n) // BLOCK_TOKENS)            # vLLM allocates the blocks this step writes
            plan = self.sched.build([ScheduledRequest(rid, [self.table[have:need]], done == 0, n)])
            steps.append(plan.saves)
            done, have = done + n, need
            req.num_computed_tokens = done
        self.sched.build([], finished_req_ids={rid})
        return steps

    def forget_stored(self) -> None:
        """Delete the prompt the daemon holds (after its leases are back), so the next save copies every key."""
        if self.stored.keys:
            wait_until(lambda: self.client.stats().leases_active == 0, what="the loads' leases to be released")
            n = self.client.delete(self.ns, self.stored.keys)
            check(n == len(self.stored.keys), f"deleted {n} of {len(self.stored.keys)} stored keys")
            self.stored = Stored()

    # -- cases -------------------------------------------------------------------------------------------
    def save_case(self, t: int, chunk: int, tick: Callable[[str], None], record_steps: bool = False) -> Case:
        w = self.workers[t]
        label = f"save copy_threads={t} chunk={chunk or 'prompt'}"

        def setup() -> tuple[list[list[SaveJob]], dict[str, float]]:
            tick(label)
            self.forget_stored()
            steps = self.prompt_steps(chunk)
            for b in self.sample:
                self.cache.stamp(b, self.n_prompts)
            return steps, dict(w.counters.totals)

        def fn(arg: tuple[list[list[SaveJob]], dict[str, float]]) -> None:
            for jobs in arg[0]:
                t0 = time.perf_counter()
                w.save(jobs)                    # what wait_for_save runs each step
                if record_steps:
                    self.step_seconds.append(time.perf_counter() - t0)
            w.drain()

        def teardown(arg: tuple[list[list[SaveJob]], dict[str, float]]) -> None:
            steps, before = arg
            keys = [k for jobs in steps for j in jobs for k in j.keys]
            got = {k: w.counters.totals.get(k, 0) - before.get(k, 0)
                   for k in ("saved_blocks", "saved_bytes", "save_skipped_blocks", "save_failures")}
            check(len(keys) == self.keys, f"the scheduler side asked to save {len(keys)} keys, expected {self.keys}")
            check(got == {"saved_blocks": self.keys, "saved_bytes": self.nbytes, "save_skipped_blocks": 0,
                          "save_failures": 0}, f"{label}: counters {got}, expected {self.keys} keys saved")
            check(all(self.client.exists(self.ns, keys)), f"{label}: not every saved key is in the store")
            self.stored = Stored(keys, {b: self.cache.block(b) for b in self.sample})
            self.counts["save_passes"] += 1
            self.counts["saved_blocks"] += got["saved_blocks"]
        return Case(fn, setup, teardown)

    def load_case(self, t: int, tick: Callable[[str], None]) -> Case:
        w = self.workers[t]
        label = f"load copy_threads={t}"

        def setup() -> tuple[LoadJob, dict[str, float]]:
            tick(label)
            check(bool(self.stored.keys), "a load needs a saved prompt: run a save case first")
            for b in self.sample:
                self.cache.stamp(b, 0)          # overwrite: the load must bring the saved bytes back
            g = self.spec.blocks_per_key
            job = LoadJob(f"load-{self.n_prompts}", None, self.stored.keys, [self.table[:len(self.stored.keys) * g]])
            return job, dict(w.counters.totals)

        def fn(arg: tuple[LoadJob, dict[str, float]]) -> None:
            w.start_loads([arg[0]])
            w.drain()

        def teardown(arg: tuple[LoadJob, dict[str, float]]) -> None:
            job, before = arg
            sent, recv = w.finished(set())
            check(recv == {job.req_id} and not sent, f"{label}: finished() said {sent}, {recv}")
            failed = w.load_errors()
            got = {k: w.counters.totals.get(k, 0) - before.get(k, 0)
                   for k in ("loaded_blocks", "loaded_bytes", "load_failed_blocks")}
            check(not failed and got == {"loaded_blocks": self.keys, "loaded_bytes": self.nbytes,
                                         "load_failed_blocks": 0},
                  f"{label}: counters {got}, {len(failed)} failed blocks; expected {self.keys} keys loaded")
            bad = [b for b in self.sample if self.cache.block(b) != self.stored.expected[b]]
            check(not bad, f"{label}: blocks {bad} differ from the bytes saved")
            self.counts["load_passes"] += 1
            self.counts["loaded_blocks"] += got["loaded_blocks"]
            self.counts["sample_blocks_compared"] += len(self.sample)
        return Case(fn, setup, teardown)

    def limit_cases(self, tick: Callable[[str], None]) -> dict[str, Case]:
        """native1, native2: the limit's candidates; memcpy_numpy: np.copyto of the same range (informational)."""
        src = self.cache.raw[:self.nbytes // self.cache.raw.itemsize]   # exactly the bytes one save moves
        dst = np.empty_like(src)
        dst.fill(0)                             # pre-fault
        triple = addrs([dst], [src])

        def make() -> Any:
            tick("limit: native copy")
            return triple
        return {**native_cases(make), "memcpy_numpy": Case(lambda _: np.copyto(dst, src),
                                                           lambda: tick("np.copyto (informational)"))}
