"""Runs a workload against one server set: every session as an asyncio task that sleeps until its start,
sends its turns one after another (each after the previous reply and the tool's think time), appends the
tokens the model generated to its context, forks its sub-agents after the fork turn and waits for them.

`route(sid, agent, turn, context)` picks the server of each call (context: the call's prompt tokens): one server,
round-robin per turn across two (the peer-tier configuration (d)), or by the store's prefix score (r: router.py). Results are per call, in a flat list, with the wall time of the whole run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from bench.serve.http_client import complete
from bench.serve.workload import Agent, Session, Workload

__all__ = ["CallResult", "RunResult", "run_workload", "round_robin"]


@dataclass(frozen=True)
class CallResult:
    sid: int
    agent: int
    turn: int
    server: int
    sent_s: float  # since the run started
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    output_ids: tuple[int, ...]


@dataclass(frozen=True)
class RunResult:
    calls: tuple[CallResult, ...]
    wall_s: float
    session_s: dict[int, float]  # session completion time: first send to last reply

    @property
    def output_tokens(self) -> int:
        return sum(len(c.output_ids) for c in self.calls)


Route = Callable[[int, int, int, Sequence[int]], int]


async def _agent(http: httpx.AsyncClient, urls: list[str], route: Route, t0: float, sid: int, agent: Agent,
                 context: list[int], out: list[CallResult], tick: Callable[[], None],
                 on_turn: Callable[[int, list[int]], asyncio.Future[None] | None] | None = None) -> list[int]:
    for k, turn in enumerate(agent.turns):
        if turn.think_s:
            await asyncio.sleep(turn.think_s)
        context.extend(turn.new_tokens)
        server = route(sid, agent.agent, k, context)
        sent = time.perf_counter() - t0
        try:
            c = await complete(http, urls[server], list(context), turn.output_tokens)
        finally:
            done = getattr(route, "done", None)  # a router that balances load hears when a call ends
            if done is not None:
                done(server)
        out.append(CallResult(sid, agent.agent, k, server, sent, c.ttft_s, c.total_s, c.prompt_tokens,
                              c.cached_tokens, c.token_ids))
        tick()
        context.extend(c.token_ids)
        if on_turn is not None:
            pending = on_turn(k, context)
            if pending is not None:
                await pending
    return context


async def _session(http: httpx.AsyncClient, urls: list[str], route: Route, t0: float, s: Session,
                   out: list[CallResult], done: dict[int, float], tick: Callable[[], None]) -> None:
    await asyncio.sleep(max(0.0, s.start_s - (time.perf_counter() - t0)))
    start = time.perf_counter()
    forks: dict[int, list[Agent]] = {}
    for a in s.subagents:
        forks.setdefault(a.fork_after, []).append(a)

    def on_turn(k: int, context: list[int]) -> asyncio.Future[None] | None:
        subs = forks.get(k)
        if not subs:
            return None
        # each sub-agent continues from a copy of the parent's context; the parent waits for all of them
        return asyncio.ensure_future(_gather([_agent(http, urls, route, t0, s.sid, a, list(context), out, tick)
                                              for a in subs]))

    await _agent(http, urls, route, t0, s.sid, s.main, [], out, tick, on_turn)
    done[s.sid] = time.perf_counter() - start


async def _gather(coros: list) -> None:
    await asyncio.gather(*coros)


async def _run(w: Workload, urls: list[str], route: Route, max_in_flight: int | None,
               tick: Callable[[], None]) -> RunResult:
    out: list[CallResult] = []
    done: dict[int, float] = {}
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0), limits=limits) as http:
        t0 = time.perf_counter()
        if max_in_flight is None:
            await asyncio.gather(*(_session(http, urls, route, t0, s, out, done, tick) for s in w.sessions))
        else:
            gate = asyncio.Semaphore(max_in_flight)

            async def bounded(s: Session) -> None:
                async with gate:
                    await _session(http, urls, route, t0, s, out, done, tick)
            await asyncio.gather(*(bounded(s) for s in w.sessions))
        wall = time.perf_counter() - t0
    return RunResult(tuple(sorted(out, key=lambda c: (c.sid, c.agent, c.turn))), wall, done)


def run_workload(w: Workload, urls: list[str], route: Route | None = None, max_in_flight: int | None = None,
                 tick: Callable[[], None] = lambda: None) -> RunResult:
    """Run `w` against `urls` (route defaults to the first server for every call); `tick` after each call."""
    return asyncio.run(_run(w, urls, route or (lambda sid, agent, turn, context: 0), max_in_flight, tick))


def round_robin(sid: int, agent: int, turn: int, context: Sequence[int] = ()) -> int:
    """Two servers, alternating per turn (offset per session and agent): a session's next turn usually lands
    on the other server, as with a load balancer that does not know where a session's KV is."""
    return (sid + agent + turn) % 2
