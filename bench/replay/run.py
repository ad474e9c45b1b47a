"""One replay point: the real store and the exact simulator at one capacity, reduced to a flat figures dict.

The dict is what the CLI prints as its JSON line and what the sweep's table and plot read, so every figure
has exactly one definition (metrics.py) and one name.

Store vs model is checked on more than the hit rate: `tier_checks` pairs each daemon counter that the model
predicts (RAM evictions, evictions of blocks with a disk copy, promotions, hits by tier, disk writes, blocks
reclaimed from disk, blocks and bytes on disk, ...) as [store, simulated]; `tier_mismatches` names those that
differ, and `mismatched_disk_hits` counts requests whose disk-served positions differ (verdict.py turns them
into the CLI's exit status). `conditions` says what the daemon ran under and where the replay waited for it.

The ceiling (belady.py): Belady's offline rule over RAM + disk as one pool of the same blocks, so the store is
read against the best any eviction could do there: `belady_hit_rate` and `belady_prefill_reduction`;
`lru_hit_rate` and `lru_prefill_reduction` (the exact LRU simulator's at this store; the store's own figures when
its policy is LRU) and `lru_share_of_belady`.

Policies: LRU, or S3-FIFO (sim_policy.py: the daemon's own policy class in the engine's event order). Under
S3-FIFO the replay always syncs lease releases, and with a disk tier records the order the daemon's promoter
threads landed each probe's promotions in (landing.py) for the simulator to follow (`landing_mismatches`:
probes where they were not the model's promotions; any is a verdict line).

Misses by cause (miss_check.py): `misses_by_cause` (the daemon's misses_* counters over the run),
`prefix_lookups_short` (the replay's prefix Lookups that stopped short) and `miss_causes_add_up`. `lru_pool_hit_rate` is a plain LRU over the same one pool (a RAM + disk store keeps
a disk copy of blocks that are also in RAM, so it holds fewer distinct blocks than the pool).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.replay.belady import BeladyPlan, belady, plan
from bench.replay.hints import simulate_hinted
from bench.replay.landing import replay_observed
from bench.replay.metrics import CostModel, HitFigures, capacity_model, disk_hit_tokens, hit_figures
from bench.replay.miss_check import miss_figures
from bench.replay.replayer import ReplayResult, memcpy_gbps, replay
from bench.replay.sim import LRUTier, SimResult, infinite_cache, simulate
from bench.replay.tiers import StoreSpec
from bench.replay.trace import BLOCK_TOKENS, Convention, Request

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
    belady_plan: BeladyPlan | None = None

    def max_result(self) -> SimResult:
        if self.maximum is None:
            self.maximum = infinite_cache(self.requests, self.convention)
        return self.maximum

    def ceiling_plan(self) -> BeladyPlan:
        """Belady's next-use table, computed once for all capacities."""
        if self.belady_plan is None:
            self.belady_plan = plan(self.requests, self.convention)
        return self.belady_plan


def _ceiling(w: Workload, spec: StoreSpec, fs: HitFigures) -> dict:
    """Belady and a one-pool LRU at RAM + disk blocks (the disk as laid out in segments), next to the simulator."""
    pool = spec.tiers[0].capacity_blocks + (spec.disk.capacity_blocks if spec.disk else 0)
    reqs, conv = w.requests, w.convention
    fb = hit_figures(reqs, belady(w.ceiling_plan(), pool).hits, conv)
    if spec.policy != "lru":  # lru_*: plain LRU at this store, whatever policy the store ran
        fs = hit_figures(reqs, simulate(reqs, spec.with_policy("lru").sim_tiers(), conv, plan=spec.write_plan).hits,
                         conv)
    fp = hit_figures(reqs, simulate(reqs, [LRUTier("pool", pool)], conv).hits, conv)
    return {"belady_blocks": pool, "belady_hit_rate": round(fb.hit_rate, 5),
            "belady_prefill_reduction": round(fb.prefill_reduction, 4), "lru_hit_rate": round(fs.hit_rate, 5),
            "lru_prefill_reduction": round(fs.prefill_reduction, 4),
            "lru_share_of_belady": round(fs.hit_rate / fb.hit_rate, 4) if fb.hit_rate else 0.0,
            "lru_pool_hit_rate": round(fp.hit_rate, 5)}


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def _mismatches(store: Sequence[int], sim: Sequence[int]) -> list[tuple[int, int, int]]:
    return [(i, a, b) for i, (a, b) in enumerate(zip(store, sim)) if a != b]


# counter name -> where the store reports it (engine counters, or the disk tier's stats)
_CHECKED = ("evictions", "evicted_to_disk", "promotions", "promotion_failures", "hit_keys_ram", "hit_keys_disk",
            "store_full", "disk_writes", "disk_write_failures", "disk_reinserted", "disk_writes_queued",
            "disk_writebacks", "evicted_unwritten", "room_waits", "demote_dropped")
_CHECKED_DISK = {"disk_evicted_blocks": "evicted_blocks", "disk_blocks": "blocks",
                 "disk_bytes_written": "bytes_written", "disk_bytes_read": "bytes_read"}


def _tier_checks(store: ReplayResult, sim: SimResult) -> dict[str, list[int]]:
    checks = {k: [store.counters.get(k, -1), sim.counters[k]] for k in _CHECKED if k in sim.counters}
    checks.update({k: [store.disk.get(v, -1), sim.counters[k]] for k, v in _CHECKED_DISK.items() if k in sim.counters})
    checks["resident_blocks"] = [store.resident_blocks, sim.resident[0]]
    checks["present_on_put"] = [store.present_on_put, sim.present_on_put]
    names = sorted({k for k in sim.counters if k.startswith("hint_")} | set(store.hint_outcomes))
    checks.update({k: [store.hint_outcomes.get(k, 0), sim.counters.get(k, 0)] for k in names})
    return checks


def _disk_figures(spec: StoreSpec, store: ReplayResult, sim: SimResult) -> dict:
    """The disk tier's size and traffic (zeros without one), and how the replay synchronised with it."""
    d = spec.disk
    record = d.record_bytes if d else 0
    reinserted = store.counters.get("disk_reinserted", 0)
    written = store.disk.get("bytes_written", 0)
    admitted = store.counters.get("disk_writes", 0) * record
    out: dict = {"disk_bytes": d.capacity_bytes if d else 0, "disk_blocks": d.capacity_blocks if d else 0,
                 "disk_segment_bytes": d.segment_bytes if d else 0, "disk_segments": d.segments if d else 0,
                 "total_tokens": spec.ram_tokens + spec.disk_tokens,
                 "mismatched_disk_hits": sum(a != b for a, b in zip(store.disk_hits, sim.disk_hits)),
                 "disk_read_bytes": store.disk.get("bytes_read", 0),
                 "sim_disk_read_bytes": sim.counters.get("disk_bytes_read", 0),
                 "promoted_bytes": store.disk.get("bytes_read", 0) - reinserted * record,
                 "disk_written_bytes": written,
                 "sim_disk_written_bytes": sim.counters.get("disk_bytes_written", 0),
                 "disk_resident_blocks": store.disk.get("blocks", 0),
                 "disk_reclaimed_blocks": store.disk.get("evicted_blocks", 0),
                 "disk_reinsert_hits": spec.disk_reinsert_hits if d else 0,
                 "disk_reinserted_blocks": reinserted,
                 "sim_disk_reinserted_blocks": sim.counters.get("disk_reinserted", 0),
                 # device bytes written per byte admitted: 1.0 for a plain FIFO log; reinsertion copies add to it
                 "disk_write_amplification": round(written / admitted, 4) if admitted else 0.0,
                 # device bytes written per byte served to readers (the write amplification: what each
                 # hit costs the SSD)
                 "disk_written_per_served": round(written / store.loaded_bytes, 4) if store.loaded_bytes else 0.0,
                 "disk_write": spec.disk_write if d else "", "disk_admission": spec.disk_admission if d else "",
                 "synced_writes": store.synced_writes,
                 "settle_s": round(store.settle_s, 2), "settle_polls": store.settle_polls}
    if d:
        out["disk_sync"] = "none"
        out["disk_note"] = ("disk_sync=none: a hit-rate replay, not a durability test. After each request the "
                            "replay waits for the disk writer to drain (synced_writes) and, before a get, for "
                            "the probe's promotions to land, so the store is deterministic")
    return out


def _conditions(spec: StoreSpec, store: ReplayResult) -> dict:
    """What the daemon ran under (read from the options it was started with) and where the replay waited for it.

    Why in every point: the store equals the model only under these conditions (watermarks 1.0: allocation
    pressure alone evicts, one block at a time; no fsync; the replay in lock-step with the daemon's background
    work, see replayer.py), so a figure quoted without them claims more than was measured."""
    o = spec.daemon_options()
    lock = [what for what, on in (("leases", store.synced_leases), ("disk writes", store.synced_writes),
                                  ("promotions", spec.disk is not None)) if on]
    c: dict = {"policy": o["policy"], "high_watermark": o["high_watermark"], "low_watermark": o["low_watermark"],
               "promote_timeout_s": o["promote_timeout_s"],
               "arena_bytes": o["arena_bytes"], "max_block_bytes": o["max_block_bytes"],
               "ram_blocks": spec.tiers[0].capacity_blocks, "lock_step": lock}
    d = spec.disk
    if d is not None:
        c.update({k: o[k] for k in ("disk_sync", "disk_write", "disk_admission", "disk_codec", "disk_reinsert_hits",
                                    "write_queue_blocks", "disk_bytes", "disk_segment_bytes")},
                 disk_segments=d.segments, disk_blocks=d.capacity_blocks)
        if spec.policy != "lru":  # the one thread race the model takes as input (landing.py)
            c["promotion_order"] = "recorded from the daemon's event stream"
    return c


def _hint_figures(w: Workload, spec: StoreSpec, f: HitFigures, out: dict) -> dict:
    """With hints: the store's figures against plain LRU (simulated at the same store) and Belady. The
    point's lru_* figures are plain LRU's then, and hint_* the hinted store's."""
    plain = hit_figures(w.requests, simulate(w.requests, spec.with_policy("lru").sim_tiers(), w.convention,
                                             plan=spec.write_plan).hits,
                        w.convention)
    bel_hr, bel_pr = out["belady_hit_rate"], out["belady_prefill_reduction"]
    return {"hint_hit_rate": round(f.hit_rate, 5), "hint_prefill_reduction": round(f.prefill_reduction, 4),
            "lru_hit_rate": round(plain.hit_rate, 5), "lru_prefill_reduction": round(plain.prefill_reduction, 4),
            "lru_share_of_belady": round(plain.hit_rate / bel_hr, 4) if bel_hr else 0.0,
            "hint_gain": round(f.prefill_reduction / plain.prefill_reduction, 4) if plain.prefill_reduction else 0.0,
            "hint_share_of_belady": round(f.hit_rate / bel_hr, 4) if bel_hr else 0.0,
            "hint_prefill_share_of_belady": round(f.prefill_reduction / bel_pr, 4) if bel_pr else 0.0}


def _store_and_sim(w: Workload, spec: StoreSpec, on_request: Callable[[], None] | None,
                   hints: bool) -> tuple[ReplayResult, SimResult]:
    """The replay and its simulation. Under LRU as ever; under another policy (S3-FIFO) the replay always waits
    for lease releases before a put (a just-loaded block can reach a queue's tail with frequency 0 there, not
    only when a request fills the RAM) and, with a disk tier, records the order its promotions landed in
    (landing.py), which the simulator then follows."""
    reqs, conv = w.requests, w.convention
    if spec.policy == "lru":
        sim = (simulate_hinted if hints else simulate)(reqs, spec.sim_tiers(), conv, plan=spec.write_plan)
        return replay(reqs, spec, convention=conv, on_request=on_request, hints=hints), sim
    model = simulate_hinted if hints else simulate
    if spec.disk is None:
        store = replay(reqs, spec, convention=conv, on_request=on_request, sync_leases=True, hints=hints)
        return store, model(reqs, spec.sim_tiers(), conv, plan=spec.write_plan)
    store, landed = replay_observed(reqs, spec, convention=conv, on_request=on_request, sync_leases=True,
                                    hints=hints)
    return store, model(reqs, spec.sim_tiers(), conv, landed=landed, plan=spec.write_plan)


def run_point(w: Workload, spec: StoreSpec, on_request: Callable[[], None] | None = None, *,
              hints: bool = False) -> dict:
    """Replay `w` through a daemon sized by `spec`, simulate the same store, and report both. hints: send
    the requests' hints to the store and model them (hints.py); the point adds _hint_figures."""
    t0 = time.perf_counter()
    reqs, conv, model = w.requests, w.convention, w.model
    best = w.max_result()
    store, sim = _store_and_sim(w, spec, on_request, hints)
    f, fs, fm = (hit_figures(reqs, h, conv) for h in (store.hits, sim.hits, best.hits))
    bad = _mismatches(store.hits, sim.hits)
    checks = _tier_checks(store, sim)
    ceiling = memcpy_gbps(spec.block_bytes)
    load_gbps = _gbps(store.loaded_bytes, store.get_s)
    tokens = f.input_tokens or 1
    disk_tok, sim_disk_tok = disk_hit_tokens(reqs, store.disk_hits), disk_hit_tokens(reqs, sim.disk_hits)
    unique = best.resident[0] * BLOCK_TOKENS
    held = spec.ram_tokens + (spec.disk.capacity_bytes // spec.bytes_per_token if spec.disk else 0)
    out: dict = {
        "trace": w.name, "cut": w.cut, "requests": len(reqs), "store": spec.label, "policy": spec.policy,
        "capacity_tokens": spec.ram_tokens, "disk_tokens": spec.disk_tokens,
        "hit_rate": round(f.hit_rate, 5), "sim_hit_rate": round(fs.hit_rate, 5), "max_hit_rate": round(fm.hit_rate, 5),
        "hit_rate_of_max": round(f.hit_rate / fm.hit_rate, 4) if fm.hit_rate else 0.0,
        "hit_rate_ram": round((f.hit_tokens - disk_tok) / tokens, 5), "hit_rate_disk": round(disk_tok / tokens, 5),
        "sim_hit_rate_ram": round((fs.hit_tokens - sim_disk_tok) / tokens, 5),
        "sim_hit_rate_disk": round(sim_disk_tok / tokens, 5),
        "prefill_reduction": round(f.prefill_reduction, 4), "max_prefill_reduction": round(fm.prefill_reduction, 4),
        "mismatched_requests": len(bad), "first_mismatches": bad[:5], "landing_mismatches": sim.landing_mismatches,
        "tier_checks": checks, "tier_mismatches": [k for k, (a, b) in checks.items() if a != b],
        "conditions": _conditions(spec, store),
        "unique_kv_tokens": unique, "store_share_of_unique": round(held / unique, 4) if unique else 0.0,
        "capacity_blocks": spec.tiers[0].capacity_blocks,
        **_disk_figures(spec, store, sim),
        **_ceiling(w, spec, fs),
        "bytes_per_token": spec.bytes_per_token, "block_bytes": spec.block_bytes,
        "arena_bytes": spec.ram_tokens * spec.bytes_per_token, "convention": conv.value,
        "block_hit_rate": round(f.block_hit_rate, 5), "sim_block_hit_rate": round(fs.block_hit_rate, 5),
        "max_block_hit_rate": round(fm.block_hit_rate, 5),
        "evictions": store.counters.get("evictions", -1), "sim_evictions": sim.evictions[0],
        "resident_blocks": store.resident_blocks, "sim_resident_blocks": sim.resident[0],
        "present_on_put": store.present_on_put, "sim_present_on_put": sim.present_on_put,
        "store_full": store.store_full, "sim_store_full": sim.store_full, "synced_leases": store.synced_leases,
        "verify_failures": store.verify_failures,
        **miss_figures(store.misses_by_cause, store.short_lookups),
        "input_tokens": f.input_tokens, "prefill_tokens_no_cache": f.input_tokens, "prefill_tokens": f.prefill_tokens,
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
    out["hints"] = hints
    if hints:
        out.update(_hint_figures(w, spec, f, out), hint_s=round(store.hint_s, 3))
    out["point_s"] = round(time.perf_counter() - t0, 2)
    return out
