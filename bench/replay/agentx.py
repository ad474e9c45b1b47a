"""A seeded generator of AgentX-shaped agentic traces, in the conversation trace's format plus session ids.

Targets (AgentX measurements quoted in DESIGN.md): a median of 43 turns a session; the context grows every
turn by the model's output and the appended tool result, to a median of ~142K input tokens at the last turn;
~444 output tokens a turn; > 96 % of each prompt equal to the previous prompt; 44 % of sessions fork
sub-agents (median 4) that inherit the parent's context and then diverge; bursty arrivals, tool-call gaps.

How each is produced, and why:
- Per-session quantities (turns, final input, sub-agent count) use stratified draws (one draw per 1/n
  quantile, shuffled), so even a 10-session run has the target medians instead of sampling noise; exactly
  round(44 % x n) sessions fork. Per-turn quantities (outputs, tool results, gaps) are plain i.i.d. draws.
- A context is append-only: full 512-token blocks keep their id; the partial last block gets a fresh id in
  every prompt (its content changes as tokens are appended), exactly what the trace format encodes.
- Every session starts with the same system prompt (tool schemas, instructions: ~12K tokens, whole blocks),
  so sessions share a prefix, as agents of one product do.
- Tool results of the main agent are lognormal weights rescaled so the last prompt lands on the session's
  final-input draw; they include the sub-agents' reports when it forked.
- A fork happens after a turn between 20 % and 80 % of the session: the sub-agents copy the parent's context,
  append their own task (the first divergent block) and run their own turns in parallel; the parent waits for
  the last one, then continues with their reports appended.
- Arrivals: sessions start in bursts (several within seconds of each other, bursts spread over the duration);
  inside a session a call follows the previous one after its decode time plus a lognormal tool gap.

Hints (`hints=True`; off by default, and the trace's requests are the same either way: no extra draws):
what an agent runtime knows and says, attached to the calls as `Request.hints` (bench/replay/trace.py Hint):
- Pin the shared system prefix after each session's first call, ttl up to the trace's last call (the
  deployment's sessions keep it live; the daemon clips it to hint_max_ttl_s and each session start renews it);
- Retain an agent's own chain (past the system prefix) after each call but its last whose tool wait is short
  (the agent's next call within `retain_within_s`, default 5 s: the runtime knows what it is waiting on), ttl =
  that think time on the trace clock. A longer wait (a slow tool; a parent waiting for its sub-agents) is left
  to the policy: a chain retained for long holds RAM that chains resuming sooner need (RAM-only, 20 sessions
  at scale 0.25, 10 % of unique KV: retaining every wait gains 1.05x prefill reduction over LRU, waits within
  5 s 1.31x; within 2 s 1.05x, 8 s 1.23x, 12 s 1.12x);
- Prefetch, before an agent's next call (the tool returned), the chain it resumes;
- Release a sub-agent's private tail (past the parent's context it forked from) after its last call, and a
  session's chain past the system prefix after its last call (nothing else reads them again).

`scale` multiplies every token count (contexts, outputs, tool results), so a quick run keeps the shape at a
fraction of the blocks. The file has `session_id` and `agent` (0 = main agent, 1.. = sub-agents) per record.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, replace

import numpy as np

from bench.replay.trace import BLOCK_TOKENS, Hint, Request

__all__ = ["AgentXParams", "generate"]


@dataclass(frozen=True)
class AgentXParams:
    sessions: int = 100
    scale: float = 1.0
    seed: int = 0
    turns_median: float = 43.0
    turns_sigma: float = 0.45
    final_input_median: float = 142_000.0
    final_input_sigma: float = 0.35
    output_median: float = 444.0
    output_sigma: float = 0.4
    system_tokens: int = 12_288
    task_tokens_median: float = 1_500.0
    tool_sigma: float = 1.0
    fork_share: float = 0.44
    subagents_median: float = 4.0
    subagent_turns_median: float = 8.0
    subagent_tool_median: float = 1_500.0
    subtask_tokens: int = 400
    report_tokens: int = 1_000
    duration_s: float = 3_600.0
    burst_mean: float = 4.0
    burst_spread_s: float = 5.0
    tool_gap_median_s: float = 2.0
    tool_gap_sigma: float = 1.0
    decode_tok_s: float = 50.0
    hints: bool = False
    retain_within_s: float = 5.0  # Retain only waits expected back within this (see the module docstring)

    def tokens(self, x: float) -> int:
        return max(1, round(x * self.scale))


class _Context:
    """An append-only prompt: ids of its full blocks plus how many tokens sit in the partial last block."""

    __slots__ = ("full", "tail")

    def __init__(self, full: list[int], tail: int = 0) -> None:
        self.full, self.tail = full, tail

    @property
    def tokens(self) -> int:
        return len(self.full) * BLOCK_TOKENS + self.tail

    def append(self, n: int, ids: itertools.count) -> None:
        total = self.tail + n
        self.full.extend(next(ids) for _ in range(total // BLOCK_TOKENS))
        self.tail = total % BLOCK_TOKENS

    def prompt(self, ids: itertools.count) -> tuple[int, ...]:
        return tuple(self.full) + ((next(ids),) if self.tail else ())

    def fork(self) -> _Context:
        return _Context(list(self.full), self.tail)


def _stratified_lognormal(rng: np.random.Generator, n: int, median: float, sigma: float) -> np.ndarray:
    """n lognormal draws, one from each 1/n quantile band, shuffled: sample quantiles hit the target."""
    inv = statistics.NormalDist().inv_cdf
    u = (rng.permutation(n) + rng.uniform(0.0, 1.0, n)) / n
    return np.array([median * math.exp(sigma * inv(min(max(x, 1e-12), 1 - 1e-12))) for x in u])


def _arrivals(rng: np.random.Generator, p: AgentXParams) -> list[float]:
    """Session start times (s): bursts of ~burst_mean sessions, bursts uniform over the duration."""
    starts: list[float] = []
    while len(starts) < p.sessions:
        t = float(rng.uniform(0.0, p.duration_s))
        size = 1 + int(rng.poisson(max(p.burst_mean - 1.0, 0.0)))
        starts.extend(t + float(rng.exponential(p.burst_spread_s)) for _ in range(size))
    return sorted(starts[: p.sessions])


class _Session:
    """Emits one session's calls: the main agent's turns, and its sub-agents when it forks."""

    def __init__(self, sid: int, p: AgentXParams, rng: np.random.Generator, ids: itertools.count,
                 system: list[int], out: list[tuple[float, int, int, Request]]) -> None:
        self.sid, self.p, self.rng, self.ids, self.out = sid, p, rng, ids, out
        self.system = system
        self.seq = 0
        self.private: dict[int, int] = {0: len(system)}  # agent -> first block position it alone holds

    def _emit(self, t: float, agent: int, ctx: _Context, output: int) -> None:
        r = Request(int(t * 1000), ctx.tokens, output, ctx.prompt(self.ids), self.sid, agent)
        self.out.append((t, self.sid, self.seq, r))
        self.seq += 1

    def _output(self) -> int:
        return self.p.tokens(self.rng.lognormal(math.log(self.p.output_median), self.p.output_sigma))

    def _model_s(self, new_tokens: int, output: int) -> float:
        """Time the model is busy with a call: prefill of what is new (the rest is cached) plus decode."""
        return new_tokens / 20_000.0 + output / self.p.decode_tok_s

    def _tool_gap_s(self) -> float:
        return float(self.rng.lognormal(math.log(self.p.tool_gap_median_s), self.p.tool_gap_sigma))

    def run(self, start: float, turns: int, final_input: int, subagents: int) -> None:
        p, rng = self.p, self.rng
        ctx = _Context(list(self.system))
        ctx.append(p.tokens(rng.lognormal(math.log(p.task_tokens_median), 0.5)), self.ids)
        outputs = [self._output() for _ in range(turns)]
        fork_at = int(rng.integers(max(1, int(0.2 * turns)), max(2, int(0.8 * turns)))) if subagents else -1
        fork_at = min(fork_at, turns - 2)
        reports = subagents * p.tokens(p.report_tokens)
        budget = final_input - ctx.tokens - sum(outputs[:-1]) - reports
        w = rng.lognormal(0.0, p.tool_sigma, max(turns - 1, 1))
        tools = np.maximum(1, np.floor(w / w.sum() * max(budget, turns - 1))).astype(int).tolist()
        t, seen = start, 0
        for k in range(turns):
            self._emit(t, 0, ctx, outputs[k])
            if k == turns - 1:
                break
            t += self._model_s(ctx.tokens - seen, outputs[k])
            seen = ctx.tokens
            ctx.append(outputs[k], self.ids)
            if k == fork_at:
                t = max(self._subagent(j + 1, t, ctx.fork()) for j in range(subagents))
                ctx.append(reports, self.ids)
            ctx.append(tools[k], self.ids)
            t += self._tool_gap_s()

    def _subagent(self, agent: int, t: float, ctx: _Context) -> float:
        """Run one sub-agent from the parent's context; the time it hands its report back."""
        p, rng = self.p, self.rng
        self.private[agent] = len(ctx.full)
        ctx.append(p.tokens(p.subtask_tokens), self.ids)
        turns = max(2, round(rng.lognormal(math.log(p.subagent_turns_median), 0.5)))
        t += float(rng.exponential(0.2))  # spawned together, not in lockstep
        seen = 0
        for k in range(turns):
            out = self._output()
            self._emit(t, agent, ctx, out)
            t += self._model_s(ctx.tokens - seen, out)
            seen = ctx.tokens
            if k < turns - 1:
                ctx.append(out + p.tokens(rng.lognormal(math.log(p.subagent_tool_median), p.tool_sigma)), self.ids)
                t += self._tool_gap_s()
        return t


def generate(p: AgentXParams) -> list[Request]:
    """The trace, in arrival order (ties broken by session and call order)."""
    if p.sessions < 1 or p.scale <= 0:
        raise ValueError(f"sessions={p.sessions}, scale={p.scale}: need sessions >= 1 and scale > 0")
    rng = np.random.default_rng(p.seed)
    n = p.sessions
    turns = np.maximum(3, np.rint(_stratified_lognormal(rng, n, p.turns_median, p.turns_sigma))).astype(int)
    finals = _stratified_lognormal(rng, n, p.final_input_median * p.scale, p.final_input_sigma)
    forks = np.zeros(n, dtype=int)
    forking = rng.permutation(n)[: round(p.fork_share * n)]
    forks[forking] = np.maximum(1, np.rint(_stratified_lognormal(rng, len(forking), p.subagents_median, 0.5)))
    system_blocks = max(1, p.tokens(p.system_tokens) // BLOCK_TOKENS)
    system = list(range(system_blocks))
    ids = itertools.count(system_blocks)
    events: list[tuple[float, int, int, Request]] = []
    sessions = []
    for sid, start in enumerate(_arrivals(rng, p)):
        s = _Session(sid, p, rng, ids, system, events)
        s.run(start, int(turns[sid]), int(finals[sid]), int(forks[sid]))
        sessions.append(s)
    if p.hints:
        events = _with_hints(events, sessions, system, p.retain_within_s)
    events.sort(key=lambda e: (e[3].timestamp_ms, e[1], e[2]))
    return [e[3] for e in events]


def _with_hints(events: list[tuple[float, int, int, Request]], sessions: list[_Session],
                system: list[int], retain_within_s: float) -> list[tuple[float, int, int, Request]]:
    """The events with each call's hints attached (see the module docstring); no random draws."""
    end_ms = max(e[3].timestamp_ms for e in events)
    calls: dict[tuple[int, int], list[int]] = {}  # (session, agent) -> event indices in call order
    for e in sorted(range(len(events)), key=lambda j: (events[j][1], events[j][2])):
        calls.setdefault((events[e][1], events[e][3].agent), []).append(e)
    hints: list[list[Hint]] = [[] for _ in events]
    for (sid, agent), idx in calls.items():
        reqs = [events[i][3] for i in idx]
        chains = [r.cacheable_ids() for r in reqs]
        if agent == 0:
            ttl = (end_ms - reqs[0].timestamp_ms) / 1000.0
            hints[idx[0]].append(Hint("pin", tuple(system), 0, max(ttl, 0.001)))
        mine = sessions[sid].private[agent] if agent else len(system)
        for k, i in enumerate(idx):
            last = k == len(idx) - 1
            if last:
                if len(chains[k]) > mine:
                    hints[i].append(Hint("release", chains[k], mine))
                continue
            gap = (reqs[k + 1].timestamp_ms - reqs[k].timestamp_ms) / 1000.0
            if len(chains[k]) > len(system) and 0 < gap <= retain_within_s:
                hints[i].append(Hint("retain", chains[k], len(system), gap))
            if chains[k]:
                hints[idx[k + 1]].insert(0, Hint("prefetch", chains[k], 0, 0.0, before=True))
    return [(t, sid, seq, replace(r, hints=tuple(h))) if h else (t, sid, seq, r)
            for (t, sid, seq, r), h in zip(events, hints)]
