"""From per-request prefix hits (in blocks) to the figures the report quotes.

One function for every source of hits (the store, the simulator, the infinite cache, no cache at all), so the
figures differ only by the hits they were given.

Conventions (stated once, here):
- hit_rate is token-level: hit tokens / input tokens, over ALL input tokens. Only full 512-token blocks are
  cacheable by default, so a prompt's partial last block always counts as computed. (vLLM also recomputes the
  last token of a fully cached prompt; that <= 1 token a request is ignored.)
- block_hit_rate is hit blocks / cacheable blocks: the dataset README's measure when partial blocks are kept.
- hit_rate_ram + hit_rate_disk = hit_rate: the hit tokens split by the tier the lookup found each block in
  (a disk hit is promoted to RAM and then loaded from there, but it is a disk hit: without the disk tier it
  would have been computed).
- prefill_reduction = prefill tokens computed without a cache / prefill tokens computed with it.
- Capacity model: a call costs uncached_prefill / prefill_rate + output / decode_rate GPU-seconds; a task is a
  session when the trace has session ids, else one request. The same per-call time is the agent's
  time-to-next-action (it waits for the model before its next tool call).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.replay.trace import Convention, Request

__all__ = ["CostModel", "HitFigures", "hit_figures", "capacity_model", "disk_hit_tokens"]


@dataclass(frozen=True)
class CostModel:
    prefill_tok_s: float = 20_000.0
    decode_tok_s: float = 50.0


@dataclass(frozen=True)
class HitFigures:
    requests: int
    input_tokens: int
    cacheable_blocks: int
    hit_blocks: int
    hit_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.cacheable_blocks if self.cacheable_blocks else 0.0

    @property
    def prefill_tokens(self) -> int:
        return self.input_tokens - self.hit_tokens

    @property
    def prefill_reduction(self) -> float:
        return self.input_tokens / self.prefill_tokens if self.prefill_tokens else float("inf")


def hit_figures(requests: Sequence[Request], hits: Sequence[int],
                convention: Convention = Convention.FULL_BLOCKS) -> HitFigures:
    if len(hits) != len(requests):
        raise ValueError(f"{len(hits)} hit counts for {len(requests)} requests")
    return HitFigures(
        requests=len(requests),
        input_tokens=sum(r.input_length for r in requests),
        cacheable_blocks=sum(len(r.cacheable_ids(convention)) for r in requests),
        hit_blocks=sum(hits),
        hit_tokens=sum(r.hit_tokens(h) for r, h in zip(requests, hits)),
    )


def disk_hit_tokens(requests: Sequence[Request], disk_hits: Sequence[Sequence[int]]) -> int:
    """Hit tokens served by disk-tier blocks, given each request's hit positions found on disk."""
    if len(disk_hits) != len(requests):
        raise ValueError(f"{len(disk_hits)} disk-hit lists for {len(requests)} requests")
    return sum(r.hit_tokens(i + 1) - r.hit_tokens(i) for r, pos in zip(requests, disk_hits) for i in pos)


def _call_seconds(requests: Sequence[Request], hits: Sequence[int], model: CostModel) -> np.ndarray:
    return np.array([(r.input_length - r.hit_tokens(h)) / model.prefill_tok_s + r.output_length / model.decode_tok_s
                     for r, h in zip(requests, hits)], dtype=np.float64)


def capacity_model(requests: Sequence[Request], hits: Sequence[int], model: CostModel) -> dict[str, float]:
    """GPU-seconds (total and per task) and, with sessions, time-to-next-action percentiles (seconds)."""
    secs = _call_seconds(requests, hits, model)
    per_task: dict[object, float] = defaultdict(float)
    for i, r in enumerate(requests):
        per_task[r.session_id if r.session_id is not None else ("request", i)] += float(secs[i])
    tasks = np.array(list(per_task.values())) if per_task else np.zeros(1)
    out = {"gpu_s": round(float(secs.sum()), 3), "tasks": len(per_task),
           "gpu_s_per_task_mean": round(float(tasks.mean()), 4),
           "gpu_s_per_task_p50": round(float(np.median(tasks)), 4)}
    in_sessions = np.array([r.session_id is not None for r in requests], dtype=bool)
    if in_sessions.any():
        ttna = secs[in_sessions]
        for q in (50, 90, 99):
            out[f"ttna_p{q}_s"] = round(float(np.percentile(ttna, q)), 4)
    return out
