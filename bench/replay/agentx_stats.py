"""The AgentX statistics of a trace, measured from its records alone (not from the generator's parameters).

Used to check the generator against its targets, and applicable to any trace with session ids and agents.

- turns: calls of the main agent (agent 0) per session; final_input: the input of its last call.
- reuse: for each call with an earlier call of the same agent, the part of the prompt equal to that previous
  prompt. Token level (`reuse_fraction`, AgentX's measure): when all of the previous prompt's full blocks are a
  prefix of this one, the whole previous prompt is taken as shared (append-only context; its partial last
  block's tokens are only re-blocked), else the common full blocks. Block level (`reuse_fraction_blocks`):
  only the common full blocks, i.e. what a block cache can serve. Both are token-weighted over the calls.
- fork share: sessions with any sub-agent; sub-agents: the median count among those sessions.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence

from bench.replay.trace import BLOCK_TOKENS, Request

__all__ = ["agentx_stats", "TARGETS", "TOKEN_TARGETS"]

TARGETS = {"median_turns": 43, "median_final_input": 142_000, "median_output": 444, "reuse_fraction": 0.96,
           "fork_share": 0.44, "median_subagents": 4}
TOKEN_TARGETS = ("median_final_input", "median_output")  # scale with the generator's --scale


def _common_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agentx_stats(requests: Sequence[Request]) -> dict[str, float]:
    last: dict[tuple[object, int], Request] = {}
    turns: dict[object, int] = defaultdict(int)
    final: dict[object, int] = {}
    agents: dict[object, set[int]] = defaultdict(set)
    shared_tok = shared_blk = total = 0
    for r in requests:
        if r.session_id is None:
            continue
        agents[r.session_id].add(r.agent)
        if r.agent == 0:
            turns[r.session_id] += 1
            final[r.session_id] = r.input_length
        prev = last.get((r.session_id, r.agent))
        last[(r.session_id, r.agent)] = r
        if prev is None:
            continue
        prev_full = prev.hash_ids[: prev.input_length // BLOCK_TOKENS]
        common = _common_blocks(prev_full, r.hash_ids)
        shared_blk += common * BLOCK_TOKENS
        shared_tok += prev.input_length if common == len(prev_full) else common * BLOCK_TOKENS
        total += r.input_length
    if not turns:
        raise ValueError("no session ids in this trace: AgentX statistics need session_id and agent")
    forked = [len(a) - 1 for a in agents.values() if len(a) > 1]
    return {
        "sessions": len(agents),
        "requests": sum(1 for r in requests if r.session_id is not None),
        "median_turns": statistics.median(turns.values()),
        "median_final_input": statistics.median(final.values()),
        "median_output": statistics.median(r.output_length for r in requests),
        "mean_output": round(statistics.fmean(r.output_length for r in requests), 1),
        "reuse_fraction": round(shared_tok / total, 4) if total else 0.0,
        "reuse_fraction_blocks": round(shared_blk / total, 4) if total else 0.0,
        "fork_share": round(len(forked) / len(agents), 4),
        "median_subagents": statistics.median(forked) if forked else 0,
    }
