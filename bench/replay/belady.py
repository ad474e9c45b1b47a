"""The ceiling: Belady's offline rule (evict the block whose next use is farthest in the future) on a trace.

Why a ceiling: every policy the replay measures (the store's LRU, S3-FIFO, LRU with agent hints) decides
with the past only. Belady knows the whole request sequence, so at the same capacity its hit rate is what
the best eviction could reach; a policy's result is read as a share of it (`lru_share_of_belady`), not only
against the infinite cache, which no finite store can reach.

The model: one pool of `capacity_blocks` blocks (RAM + disk together: the ceiling asks what that much room
could hold, not how a tier split moves blocks), the same requests, the same chained keys
(`bench.replay.keys.chain_keys` of `Request.cacheable_ids(convention)`) and the same prefix rule as sim.py:
a request hits its leading run of cached blocks; its missing blocks are then inserted in chain order. A
block's "use" is a lookup of a request whose chain holds its key; never used again = infinitely far.

The rule, per insert that needs room: the victim is the cached block with the farthest next use (ties: the
deepest in its chain first). The blocks of the request being served (its hits, its inserts, a cached tail
behind its miss) are never its victims. With `bypass` (the default) the incoming block is a candidate too:
when it is itself the farthest, it is not stored (and neither is the rest of its chain: a chained key's
next use is never earlier than its parent's, and it is deeper) - evicting a nearer block for it could only
lose hits. `bypass=False` is the textbook demand-paging form (always store, evict someone).

Only approximately optimal for prefix hits: the textbook proof counts each block's hit on its own, while
here a block hits only when its whole prefix is cached, so evicting a head block invalidates its tail's
usefulness, and a block is worth more than its own next use says. The depth tie-break and the chain
property above (a child is never needed before its parent) keep the rule from evicting a head before its
tail for the same next use, but the rule is not proven optimal under prefix coupling: it is the standard
farthest-next-use rule, used as an upper-bound proxy, not a proof of the bound. Tests check that it beats
LRU at the same capacity on the real traces.

Cost: each key's request positions are computed once (a backward pass: the next request index of every
block reference), then one pass with a max-heap of (next use, depth) entries invalidated lazily (an entry
is live while its block is cached and its next use is the one in the entry): O(references x log).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from bench.replay.keys import chain_keys
from bench.replay.trace import Convention, Request

__all__ = ["BeladyPlan", "BeladyResult", "plan", "belady"]


@dataclass(frozen=True)
class BeladyPlan:
    """A request sequence as interned block ids, with each reference's next use: what every capacity reuses."""

    chains: list[list[int]]  # per request: its cacheable blocks' ids, in chain order
    nexts: list[list[int]]  # per request and position: the next request index that holds this block, or never
    blocks: int  # distinct blocks in the trace
    never: int  # the "never again" request index (past the last request)
    convention: Convention


@dataclass
class BeladyResult:
    """Per-request prefix hits in blocks (what metrics.hit_figures reads), and what the run did."""

    hits: list[int]
    capacity_blocks: int | None
    stored_blocks: int = 0
    evictions: int = 0
    bypassed: int = 0  # blocks not stored because they were the farthest (bypass) or no block could make room
    resident: int = 0


def plan(requests: Sequence[Request], convention: Convention = Convention.FULL_BLOCKS) -> BeladyPlan:
    """Intern every chained key and compute each reference's next use, once for all capacities."""
    ids: dict[bytes, int] = {}
    chains: list[list[int]] = []
    for r in requests:
        chains.append([ids.setdefault(k, len(ids)) for k in chain_keys(r.cacheable_ids(convention))])
    never = len(requests)
    upcoming = [never] * len(ids)  # block id -> the next request (after the one being scanned) that holds it
    nexts: list[list[int]] = [[]] * len(chains)
    for i in range(len(chains) - 1, -1, -1):
        chain = chains[i]
        nexts[i] = [upcoming[b] for b in chain]
        for b in chain:
            upcoming[b] = i
    return BeladyPlan(chains, nexts, len(ids), never, convention)


def belady(requests: Sequence[Request] | BeladyPlan, capacity_blocks: int | None,
           convention: Convention = Convention.FULL_BLOCKS, *, bypass: bool = True) -> BeladyResult:
    """Replay with Belady's rule at `capacity_blocks` (None: unbounded, the infinite cache)."""
    if capacity_blocks is not None and capacity_blocks < 0:
        raise ValueError(f"capacity_blocks={capacity_blocks} must be >= 0 (or None: unbounded)")
    p = requests if isinstance(requests, BeladyPlan) else plan(requests, convention)
    cap = p.blocks if capacity_blocks is None else capacity_blocks
    cached = bytearray(p.blocks)
    cur = [0] * p.blocks  # a cached block's next use (its live heap entry carries the same)
    mine = [-1] * p.blocks  # the request whose chain holds the block, while that request is served
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block): the top is the farthest, deepest
    push, pop = heapq.heappush, heapq.heappop
    out = BeladyResult([], capacity_blocks)
    size = 0
    for i, (chain, nxt) in enumerate(zip(p.chains, p.nexts)):
        h = 0
        while h < len(chain) and cached[chain[h]]:
            h += 1
        out.hits.append(h)
        for d, b in enumerate(chain):
            mine[b] = i
            if cached[b]:  # a hit or a cached tail: its next use moves on (the old entry goes stale)
                cur[b] = nxt[d]
                push(heap, (-nxt[d], -d, b))
        held: list[tuple[int, int, int]] = []  # this request's own entries, popped while looking for a victim
        for d in range(h, len(chain)):
            b = chain[d]
            if cached[b]:
                continue
            if size >= cap:
                victim = None
                while heap:
                    e = heap[0]
                    v = e[2]
                    if not cached[v] or cur[v] != -e[0]:
                        pop(heap)  # stale
                    elif mine[v] == i:
                        held.append(pop(heap))
                    else:
                        victim = v
                        break
                if victim is None or (bypass and (heap[0][0], heap[0][1]) >= (-nxt[d], -d)):
                    out.bypassed += len(chain) - d - sum(cached[c] for c in chain[d:])
                    break  # no room, or the incoming block is the farthest: the rest of the chain is farther
                pop(heap)
                cached[victim] = 0
                size -= 1
                out.evictions += 1
            cached[b] = 1
            cur[b] = nxt[d]
            size += 1
            out.stored_blocks += 1
            push(heap, (-nxt[d], -d, b))
        for e in held:
            push(heap, e)
    out.resident = size
    return out
