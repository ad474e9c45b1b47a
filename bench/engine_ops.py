"""The engine's hot operations in-process (no daemon, no RPC): what one control-plane call costs the daemon's CPU.

Why: the same-node fast path answers a 280-key Lookup end to end in a budget of ~150 us, and the engine's own
Python work (checks, index look-ups, numpy, counters, the policy) is part of every call. This times the engine
methods directly on a 64 MiB arena of 64 KiB blocks, LRU policy, no disk tier:

  lookup280        Engine.lookup(ns, 280 stored keys, prefix=True, lease=False)  (the scheduler's probe)
  lookup280_lease  the same with lease=True (the lease is released untimed)
  get280           lookup(lease=True) + release([lease]) timed together (what a get costs the engine)
  release280       release([lease of 280 blocks]) (the lookup is untimed)
  put1, put32      reserve + commit of 1 / 32 fresh keys (deleted again untimed, so no eviction is timed;
                   the read buffer is applied untimed first)
  apply280         the deferred policy work of one lookup280: sweep() applying its 280 hits to the LRU (the
                   engine does this under its lock before the next commit, eviction or sweep; a run of
                   identical Lookups costs about one of these in all, since only an id's last hit counts)
  exists1/280      Engine.exists of 1 / 280 stored keys

No limit column: the engine is bookkeeping in Python, and no copy or syscall bounds it from below (a dict
look-up of 280 keys in a Python loop is not a physical limit). These are product numbers, to track against
their own earlier values: run this script on the previous commit with --json-out, then on this one with
--baseline pointing at that file, back to back (the box is noisy); the table then quotes after/before ratios.
Cases run round-robin after warm-up, so each one runs with the caches the others leave (as in the daemon,
where a call runs between RPC and socket work): a case looped alone is faster (exists1: ~6 us alone, ~9-13
here). Medians and p90 in microseconds (bench/_common.py). The last stdout line is one JSON object:
{"<case>_us": median, ...} plus {"<case>_ratio": median / baseline median} with --baseline.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import numpy as np

from bench._common import Case, emit_json, interleave, print_table
from kvstore.arena.allocator import SlabAllocator
from kvstore.arena.layout import ArenaLayout
from kvstore.engine.engine import Engine
from kvstore.engine.results import EngineConfig
from kvstore.policies import make_policy

MIB = 1 << 20
BLOCK = 64 * 1024
LOOKUP_KEYS = 280


def _engine() -> Engine:
    lay = ArenaLayout.for_capacity("bench", 64 * MIB, 4 * MIB)
    gens = np.zeros(lay.gen_table_bytes // 8, dtype=np.uint64)
    return Engine(EngineConfig(max_block_bytes=4 * MIB), lay, gens,
                  SlabAllocator(lay.data_offset, lay.data_bytes, 4 * MIB), make_policy("lru"))


def _cases(eng: Engine, keys: list[bytes]) -> dict[str, Case]:
    ns = "ns"
    one = keys[:1]

    def fresh(n: int) -> Callable[[], list[bytes]]:
        def setup() -> list[bytes]:
            eng.sweep()  # applies the hits other cases left in the read buffer: apply280 times that part
            return [os.urandom(16) for _ in range(n)]
        return setup

    def probed() -> None:
        eng.sweep()
        eng.lookup(ns, keys, prefix=True, lease=False)

    def put(batch: list[bytes]) -> None:
        r = eng.reserve(ns, batch, [BLOCK] * len(batch))
        eng.commit(r.reservation_id)

    def leased() -> int:
        return eng.lookup(ns, keys, prefix=True, lease=True).lease_id

    return {
        "lookup280": Case(lambda _: eng.lookup(ns, keys, prefix=True, lease=False)),
        # setup hands a list that the timed call fills with its lease id; teardown releases it
        "lookup280_lease": Case(lambda held: held.append(leased()), setup=list, teardown=eng.release),
        "get280": Case(lambda _: eng.release([eng.lookup(ns, keys, prefix=True, lease=True).lease_id])),
        "release280": Case(lambda lid: eng.release([lid]), setup=leased),
        "put1": Case(put, setup=fresh(1), teardown=lambda b: eng.delete(ns, b)),
        "put32": Case(put, setup=fresh(32), teardown=lambda b: eng.delete(ns, b)),
        "apply280": Case(lambda _: eng.sweep(), setup=probed),
        "exists1": Case(lambda _: eng.exists(ns, one)),
        "exists280": Case(lambda _: eng.exists(ns, keys)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=0.5, help="timed seconds per case (after warm-up)")
    ap.add_argument("--json-out", default=None, help="also write the JSON line to this file")
    ap.add_argument("--baseline", default=None, help="a JSON line of an earlier run (--json-out): quote ratios")
    args = ap.parse_args()
    base: dict[str, float] = {}
    if args.baseline:
        with open(args.baseline) as fh:
            base = json.loads(fh.read().strip().splitlines()[-1])

    eng = _engine()
    eng.register_namespace("ns")
    keys = [os.urandom(16) for _ in range(LOOKUP_KEYS)]
    r = eng.reserve("ns", keys, [BLOCK] * LOOKUP_KEYS)
    eng.commit(r.reservation_id)
    samples = interleave(_cases(eng, keys), warmup=50, min_iters=200, max_iters=20_000, budget_s=args.budget)
    out: dict[str, float] = {f"{k}_us": round(s.p50 * 1e6, 2) for k, s in samples.items()}
    ratios = {f"{k}_ratio": round(out[f"{k}_us"] / base[f"{k}_us"], 3) for k in samples if base.get(f"{k}_us")}
    header = ["case", "p50 us", "p90 us", "iterations"] + (["baseline p50 us", "after/before"] if base else [])
    rows = [[k, f"{s.p50 * 1e6:.1f}", f"{s.p90 * 1e6:.1f}", len(s)]
            + ([base.get(f"{k}_us", "-"), ratios.get(f"{k}_ratio", "-")] if base else []) for k, s in samples.items()]
    print_table("engine hot operations (in-process, us)", header, rows)
    emit_json(out | ratios, args.json_out)


if __name__ == "__main__":
    main()
