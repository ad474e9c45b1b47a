"""One configuration measured: vLLM's prefix cache reset, counters read around the agentic pass (TTFT, hits,
prefill tokens) and the saturated pass (throughput), both over the same sessions as every other configuration.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from bench.serve.driver import Route, RunResult, round_robin, run_workload
from bench.serve.http_client import reset_prefix_cache
from bench.serve.scrape import VLLM_COUNTERS, delta, scrape
from bench.serve.workload import Workload, unique_prompts

__all__ = ["ConfigRun", "measure_config", "reset_all", "warm_up"]

WARM_SEED = 1 << 20  # warm-up prompts' seeds: far from the workloads' (run.py: seed .. seed + 2 + rounds)
_warm_ups = itertools.count()


@dataclass
class ConfigRun:
    key: str
    label: str
    agentic: RunResult
    saturated: RunResult | None
    vllm: dict[str, float] = field(default_factory=dict)  # counter deltas over the agentic pass, all servers
    saturated_vllm: dict[str, float] = field(default_factory=dict)  # the same over the saturated pass
    store_served_bytes: dict[str, float] = field(default_factory=dict)  # by tier, agentic pass
    router: dict[str, int] = field(default_factory=dict)  # (r): calls the prefix score decided, calls round-robin


def reset_all(urls: list[str]) -> None:
    async def go() -> None:
        async with httpx.AsyncClient(timeout=60.0) as http:
            for u in urls:
                await reset_prefix_cache(http, u)
    asyncio.run(go())


def warm_up(urls: list[str]) -> None:
    """One short untimed request to each server, then every prefix cache reset: no measured pass pays for a
    server's first use (a connector's first contact with its daemon, an engine that sat idle while the others
    ran: measured 15-20 % slower on the no-reuse prompts), and none starts with anything cached. The warm-up's
    tokens are new each time (nothing hits) and unrelated to every workload's."""
    for u in urls:
        run_workload(unique_prompts(1, 256, 2, seed=WARM_SEED + next(_warm_ups)), [u])
    reset_all(urls)


def _vllm_counters(urls: list[str]) -> dict[str, float]:
    total: dict[str, float] = {}
    for u in urls:
        for k, v in scrape(u + "/metrics", VLLM_COUNTERS).items():
            total[k] = total.get(k, 0.0) + v
    return total


def _store_counters(metrics_urls: list[str]) -> dict[str, float]:
    """What the daemons served: bytes handed to readers by the loads (leased Lookups), by tier ("ram",
    "disk"), and tokens found on peers ("peer_tokens": found by the scheduler's probe, fetched into the local
    RAM in the background, then loaded from there). Not kvstore_hit_tokens for RAM and disk: it counts every
    Lookup's hits, and the connector looks a prefix up twice (the scheduler's probe, then the load)."""
    total: dict[str, float] = {}
    for u in metrics_urls:
        for k, v in scrape(u, ("kvstore_hit_bytes_total",), by_label="tier").items():
            tier = k.split("tier=")[-1].rstrip("]")
            total[tier] = total.get(tier, 0.0) + v
        for k, v in scrape(u, ("kvstore_hit_tokens_total",), by_label="tier").items():
            if k.endswith("tier=peer]"):
                total["peer_tokens"] = total.get("peer_tokens", 0.0) + v
    return total


def measure_config(key: str, label: str, urls: list[str], store_metrics: list[str], agentic: Workload,
                   saturated: Workload | None, tick: Callable[[], None], route: Route | None = None) -> ConfigRun:
    """`route`: how calls are spread over several servers (default: round-robin per turn)."""
    route = route or (round_robin if len(urls) > 1 else None)
    warm_up(urls)
    v0, s0 = _vllm_counters(urls), _store_counters(store_metrics)
    a = run_workload(agentic, urls, route, tick=tick)
    v1, s1 = _vllm_counters(urls), _store_counters(store_metrics)
    sat, sat_counters = None, {}
    if saturated is not None:
        reset_all(urls)  # counters do not move with a reset: the saturated pass counts from v1
        sat = run_workload(saturated, urls, route, tick=tick)
        sat_counters = delta(v1, _vllm_counters(urls))
    summary = getattr(route, "summary", None)
    return ConfigRun(key, label, a, sat, vllm=delta(v0, v1), saturated_vllm=sat_counters,
                     store_served_bytes=delta(s0, s1), router=summary() if summary is not None else {})
