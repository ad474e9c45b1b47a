"""Trace replay: the real store and an exact simulator on the same workload (issue 6: RAM and disk tiers).

`python -m bench.replay --help` runs it. One concern a module:

- trace.py        load / write the Mooncake JSONL format; which blocks of a request are cacheable
- keys.py         stable chained block keys (sha256, fixed seed) and the content marks a load verifies
- tiers.py        the store under test (RAM, disk segments; capacities in tokens) for daemon and simulator
- sim.py          offline exact simulation: the LRU RAM tier, `simulate`, the infinite-cache maximum
- sim_cache.py    the store model: what a request does to RAM and disk in the daemon's order, per disk_write
                  (commit, evict), admission and write budget (WritePlan)
- sim_disk.py     the segment-log disk tier (oldest segment reclaimed, second chance for records read since
                  written, none for a block RAM holds under evict)
- sim_policy.py   the S3-FIFO RAM tier for sim.py: the daemon's own policy (and hint) classes driven in the
                  engine's order
- landing.py      the order the daemon's promoter threads landed promotions in, read from its event stream
- belady.py       the ceiling: Belady's offline farthest-next-use eviction over RAM + disk as one pool
- miss_check.py   the daemon's misses by cause over a run, checked to add up to the probes that stopped short
- replayer.py     the connector's lookup -> load -> put loop through a real daemon and client
- metrics.py      hit rates, prefill reduction, the GPU-seconds capacity model, time-to-next-action
- run.py          one capacity point: store + simulator -> one flat figures dict (with the run's conditions)
- verdict.py      every difference between store and simulator, named; any one makes the CLI exit 2
- report.py       the sweep's markdown table and PNG (RAM-only and RAM+disk lines)
- agentx.py       seeded AgentX-shaped trace generator (with the hints an agent runtime sends: hints=True);
                  agentx_stats.py measures its statistics
- hints.py        agent hints: what the replay sends when (trace clock), the exact model of the daemon's rules
- hints_cli.py    --hints: LRU, S3-FIFO, each with hints (the real store) and Belady at 10 % and 25 % of unique KV
- hints_plot.py   --hints' PNG: hit rate and prefill reduction per policy and share
- writes_cli.py   --writes: disk_write x admission (the store) and write budgets (the simulator): hit rate
                  against disk bytes written, a table and a PNG
- cli.py          the command line; __main__.py runs it
"""

from __future__ import annotations

from bench.replay.agentx import AgentXParams, generate
from bench.replay.keys import SEED, chain_keys
from bench.replay.sim import CacheSim, LRUTier, SegmentLog, SimTier, WritePlan, infinite_cache, simulate
from bench.replay.tiers import DiskLayout, StoreSpec, TierSpec
from bench.replay.trace import BLOCK_TOKENS, Convention, Hint, Request, load_trace, write_trace

__all__ = ["AgentXParams", "generate", "SEED", "chain_keys", "CacheSim", "LRUTier", "SegmentLog", "SimTier", "WritePlan",
           "infinite_cache", "simulate", "DiskLayout", "StoreSpec", "TierSpec", "BLOCK_TOKENS", "Convention",
           "Hint", "Request", "load_trace", "write_trace"]
