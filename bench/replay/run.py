"""One replay point: the real store and the exact simulator at one capacity, reduced to a flat figures dict.

The dict is what the CLI prints as its JSON line and what the sweep's table and plot read, so every figure
has exactly one definition (metrics.py) and one name.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.replay.metrics import CostModel, capacity_model, hit_figures
from bench.replay.replayer import memcpy_gbps, replay
from bench.replay.sim import SimResult, infinite_cache, simulate
from bench.replay.tiers import StoreSpec
from bench.replay.trace import Convention, Request

__all__ = ["Workload", "run_point"]


@dataclass
class Workload:
    """A trace ready to replay, with its infinite-cache maximum computed once for all capacities."""

    name: str
    cut: str | None
    requests: Sequence[Request]
    convention: Convention
    model: CostModel
    maximum: SimResult | None = None

    def max_result(self) -> SimResult:
        if self.maximum is None:
            self.maximum = infinite_cache(self.requests, self.convention)
        return self.maximum


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def _mismatches(store: Sequence[int], sim: Sequence[int]) -> list[tuple[int, int, int]]:
    return [(i, a, b) for i, (a, b) in enumerate(zip(store, sim)) if a != b]


def run_point(w: Workload, spec: StoreSpec, on_request: Callable[[], None] | None = None) -> dict:
    """Replay `w` through a daemon sized by `spec`, simulate the same store, and report both."""
    t0 = time.perf_counter()
    reqs, conv, model = w.requests, w.convention, w.model
    sim = simulate(reqs, spec.sim_tiers(), conv)
    best = w.max_result()
    store = replay(reqs, spec, convention=conv, on_request=on_request)
    f, fs, fm = (hit_figures(reqs, h, conv) for h in (store.hits, sim.hits, best.hits))
    bad = _mismatches(store.hits, sim.hits)
    ceiling = memcpy_gbps(spec.block_bytes)
    load_gbps = _gbps(store.loaded_bytes, store.get_s)
    out: dict = {
        "trace": w.name, "cut": w.cut, "requests": len(reqs), "store": spec.label, "policy": spec.policy,
        "capacity_tokens": spec.ram_tokens, "capacity_blocks": spec.tiers[0].capacity_blocks,
        "bytes_per_token": spec.bytes_per_token, "block_bytes": spec.block_bytes,
        "arena_bytes": spec.ram_tokens * spec.bytes_per_token, "convention": conv.value,
        "hit_rate": round(f.hit_rate, 5), "sim_hit_rate": round(fs.hit_rate, 5), "max_hit_rate": round(fm.hit_rate, 5),
        "hit_rate_of_max": round(f.hit_rate / fm.hit_rate, 4) if fm.hit_rate else 0.0,
        "block_hit_rate": round(f.block_hit_rate, 5), "sim_block_hit_rate": round(fs.block_hit_rate, 5),
        "max_block_hit_rate": round(fm.block_hit_rate, 5),
        "mismatched_requests": len(bad), "first_mismatches": bad[:5],
        "evictions": store.counters.get("evictions", -1), "sim_evictions": sim.evictions[0],
        "resident_blocks": store.resident_blocks, "sim_resident_blocks": sim.resident[0],
        "present_on_put": store.present_on_put, "sim_present_on_put": sim.present_on_put,
        "store_full": store.store_full, "synced_leases": store.synced_leases, "sim_store_full": sim.store_full, "verify_failures": store.verify_failures,
        "input_tokens": f.input_tokens, "prefill_tokens_no_cache": f.input_tokens, "prefill_tokens": f.prefill_tokens,
        "prefill_reduction": round(f.prefill_reduction, 4), "max_prefill_reduction": round(fm.prefill_reduction, 4),
        "loaded_bytes": store.loaded_bytes, "stored_bytes": store.stored_bytes,
        "load_gbps": load_gbps, "put_gbps": _gbps(store.stored_bytes, store.put_s),
        "memcpy_gbps": round(ceiling, 2), "load_of_memcpy": round(load_gbps / ceiling, 3) if ceiling else 0.0,
        "lookup_ms_mean": round(store.lookup_s / len(reqs) * 1e3, 3) if reqs else 0.0,
        "requests_per_s": round(len(reqs) / store.wall_s, 1) if store.wall_s else 0.0,
        "replay_s": round(store.wall_s, 2),
        "prefill_tok_s": model.prefill_tok_s, "decode_tok_s": model.decode_tok_s,
    }
    for suffix, hits in (("", store.hits), ("_no_cache", [0] * len(reqs)), ("_max", best.hits)):
        out.update({k + suffix: v for k, v in capacity_model(reqs, hits, model).items() if k != "tasks" or not suffix})
    out["point_s"] = round(time.perf_counter() - t0, 2)
    return out
