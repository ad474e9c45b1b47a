"""Agent sessions for the serving benchmark, from bench.replay.agentx, as token ids.

agentx gives each session's calls (prompt length, output length) for the main agent and its sub-agents; this
turns them into what an agent framework sends: turn k's prompt is turn k-1's prompt, the tokens the model
actually generated (the driver appends them), then the tool's output (new tokens). A sub-agent starts from its
parent's context right after the fork turn's output, plus its own task; the parent's next turn carries the
sub-agents' reports. Every session starts with the same system prompt (tool schemas), as agents of one
product do. Token ids are seeded per (session, agent, turn), so every configuration gets the same sessions.

Think times (tool calls) follow agentx's lognormal tool gap; session starts follow its bursty arrivals.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from bench.replay.agentx import AgentXParams, generate
from bench.replay.trace import BLOCK_TOKENS

__all__ = ["Turn", "Agent", "Session", "Workload", "agent_sessions", "unique_prompts", "saturated", "PRESETS"]

VOCAB_LO, VOCAB_HI = 3, 8192  # ids 0-2 are special in the model's config


@dataclass(frozen=True)
class Turn:
    new_tokens: tuple[int, ...]  # appended after the context (first turn: the whole first prompt)
    output_tokens: int
    think_s: float  # tool time before this turn is sent (0 for a first turn)


@dataclass(frozen=True)
class Agent:
    agent: int  # 0 = the main agent
    turns: tuple[Turn, ...]
    fork_after: int = -1  # sub-agents: the parent's turn after whose output they start


@dataclass(frozen=True)
class Session:
    sid: int
    start_s: float
    main: Agent
    subagents: tuple[Agent, ...]

    @property
    def calls(self) -> int:
        return len(self.main.turns) + sum(len(a.turns) for a in self.subagents)


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    max_prompt_tokens: int  # the longest prompt plus its output: max_model_len must hold it

    @property
    def calls(self) -> int:
        return sum(s.calls for s in self.sessions)


# Scaled AgentX shapes: contexts of a few thousand tokens (prefill costs seconds on this CPU), short generations,
# forks into sub-agents, a shared system prompt. What is kept from AgentX, because it decides what a store can
# win: > 96 % of a turn's prompt was in the previous one (p50 0.97-0.98 here: a long first prompt, the task and
# its files, then short tool results), and the shared system prompt is a small part of a prompt (12K of a ~71K
# mean there; 256-384 tokens of ~1.8-2K here): a system prompt that is half of every prompt stays in vLLM's own
# cache and hides what happens to the rest of the context.
PRESETS: dict[str, AgentXParams] = {
    "quick": AgentXParams(sessions=6, seed=7, turns_median=8.0, turns_sigma=0.3, final_input_median=2_400.0,
                          final_input_sigma=0.2, output_median=16.0, output_sigma=0.3, system_tokens=256,
                          task_tokens_median=1_300.0, fork_share=0.34, subagents_median=2.0,
                          subagent_turns_median=3.0, subagent_tool_median=80.0, subtask_tokens=80,
                          report_tokens=60, duration_s=10.0, burst_mean=3.0, burst_spread_s=2.0,
                          tool_gap_median_s=2.0, tool_gap_sigma=1.0),
    "full": AgentXParams(sessions=10, seed=7, turns_median=10.0, turns_sigma=0.35, final_input_median=3_000.0,
                         final_input_sigma=0.25, output_median=24.0, output_sigma=0.35, system_tokens=384,
                         task_tokens_median=1_500.0, fork_share=0.44, subagents_median=3.0,
                         subagent_turns_median=3.0, subagent_tool_median=100.0, subtask_tokens=100,
                         report_tokens=80, duration_s=30.0, burst_mean=4.0, burst_spread_s=3.0,
                         tool_gap_median_s=1.0, tool_gap_sigma=0.6),
}


def _tokens(seed: int, *where: int, n: int) -> tuple[int, ...]:
    rng = np.random.default_rng([seed, *where])
    return tuple(int(x) for x in rng.integers(VOCAB_LO, VOCAB_HI, n))


def _turns(seed: int, sid: int, agent: int, calls: list[tuple[int, int]], first_new: tuple[int, ...],
           p: AgentXParams) -> tuple[Turn, ...]:
    """calls: (prompt length, output length) in order; turn k>0 appends prompt_k - prompt_{k-1} - output_{k-1}."""
    rng = np.random.default_rng([seed, sid, agent, 1 << 20])
    out = [Turn(first_new, calls[0][1], 0.0)]
    for k in range(1, len(calls)):
        n = calls[k][0] - calls[k - 1][0] - calls[k - 1][1]
        if n < 1:
            raise ValueError(f"session {sid} agent {agent} turn {k}: agentx appended {n} tokens")
        think = float(rng.lognormal(math.log(p.tool_gap_median_s), p.tool_gap_sigma))
        out.append(Turn(_tokens(seed, sid, agent, k, n=n), calls[k][1], think))
    return tuple(out)


def agent_sessions(preset: str | AgentXParams, seed: int = 0) -> Workload:
    p = PRESETS[preset] if isinstance(preset, str) else preset
    by_agent: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    first_ms: dict[int, int] = {}
    for r in generate(p):
        sid = int(r.session_id)  # type: ignore[arg-type]  # AgentX records always carry an int session_id
        by_agent[(sid, r.agent)].append((r.input_length, r.output_length))
        first_ms.setdefault(sid, r.timestamp_ms)
    system = _tokens(seed, 1 << 30, n=max(1, p.tokens(p.system_tokens) // BLOCK_TOKENS) * BLOCK_TOKENS)
    sessions: list[Session] = []
    for sid in sorted(first_ms):
        main_calls = by_agent[(sid, 0)]
        task = _tokens(seed, sid, 0, 0, n=main_calls[0][0] - len(system))
        main = Agent(0, _turns(seed, sid, 0, main_calls, system + task, p))
        subs: list[Agent] = []
        for agent in sorted(a for s, a in by_agent if s == sid and a > 0):
            calls = by_agent[(sid, agent)]
            subtask = p.tokens(p.subtask_tokens)
            base = calls[0][0] - subtask  # the parent's prompt + output at the fork
            ends = [lp + lo for lp, lo in main_calls]
            if base not in ends:
                raise ValueError(f"session {sid} sub-agent {agent}: no parent turn ends at {base} tokens")
            subs.append(Agent(agent, _turns(seed, sid, agent, calls, _tokens(seed, sid, agent, 0, n=subtask), p),
                              fork_after=ends.index(base)))
        sessions.append(Session(sid, first_ms[sid] / 1000.0, main, tuple(subs)))
    t0 = min(s.start_s for s in sessions)
    sessions = [Session(s.sid, s.start_s - t0, s.main, s.subagents) for s in sessions]
    longest = max(lp + lo for calls in by_agent.values() for lp, lo in calls)
    return Workload(preset if isinstance(preset, str) else "custom", tuple(sessions), longest)


def unique_prompts(n: int, tokens: int, output: int, seed: int = 0) -> Workload:
    """The no-reuse workload: n one-turn sessions with unrelated prompts, all sent at once (the driver bounds
    how many are in flight). Nothing can hit; what the connector costs shows in the throughput."""
    sessions = tuple(Session(i, 0.0, Agent(0, (Turn(_tokens(seed, 1 << 29, i, n=tokens), output, 0.0),)), ())
                     for i in range(n))
    return Workload("no-reuse", sessions, tokens + output)


def saturated(w: Workload) -> Workload:
    """The same sessions with every start at 0 and no think time: the server is never idle, so output tokens
    per second measure how much work it gets through (the throughput pass), not the sessions' schedule."""
    def agent(a: Agent) -> Agent:
        return Agent(a.agent, tuple(Turn(t.new_tokens, t.output_tokens, 0.0) for t in a.turns), a.fork_after)
    return Workload(w.name + "-saturated",
                    tuple(Session(s.sid, 0.0, agent(s.main), tuple(agent(a) for a in s.subagents))
                          for s in w.sessions), w.max_prompt_tokens)
