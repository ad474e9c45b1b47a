"""The replay loop across a cluster: each request goes to one node, which does what a vLLM connector does.

Per request, on the node the router picks (round-robin over the live nodes, or the session's node by
rendezvous over the live nodes: a session stays put until its node goes):
  1. lookup_prefix(keys): the scheduler's question (no lease); its wall time is the scheduler-lookup latency.
     On a cluster it probes the owners of the blocks the node lacks, one call per peer.
  2. get_many_into(the hit keys): the load; every loaded block's marks are checked (bench/replay/keys.py), a
     block whose marks do not match its key is a wrong block (it must never happen).
  3. put_many(the rest, stamped): the save; the node pushes each block to its owner in the background.
A call that raises is a failed call (the request then counts as a miss from there on). The hit of a request is
its verified loaded blocks. One Record per request.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from bench.replay.keys import KEY_BYTES, chain_keys, stamp
from bench.replay.trace import Request
from kvstore.client import Client
from kvstore.errors import KVStoreError
from kvstore.peer.placement import owners

__all__ = ["NS", "Record", "drive", "by_session", "round_robin", "register"]

NS = "cluster@bench/t"
_TAIL = 8


@dataclass(frozen=True)
class Record:
    t: float          # seconds since the run started, when the request ended
    node: str
    blocks: int       # cacheable blocks of the request
    hit: int          # blocks loaded and verified
    lookup_s: float   # the scheduler lookup's wall time
    wrong: int        # loaded blocks whose marks did not match (wrong bytes)
    failed: int       # calls that raised


Route = Callable[[Request, int, list[str]], str]


def round_robin(r: Request, i: int, live: list[str]) -> str:
    return live[i % len(live)]


def by_session(r: Request, i: int, live: list[str]) -> str:
    """The session's node: rendezvous over the live nodes (stays put until that node goes). A trace without
    session ids is routed by its first two block ids: the conversation trace's requests all begin with block 0
    (a shared system prompt), and the second names the conversation (1,895 distinct in its first 900 s; a
    prefix-aware router's choice)."""
    session = r.session_id if r.session_id is not None else (r.hash_ids[:2] if r.hash_ids else i)
    return owners("session", str(session).encode(), live, 1)[0]


def register(client: Client) -> None:
    client.register_namespace(NS, model="cluster-bench", layout_digest="bench", tenant="t")


def _checked(rows: np.ndarray, keys: Sequence[bytes], sizes: Sequence[int | None]) -> tuple[int, int]:
    """(leading blocks returned with their own marks: the usable hit, blocks returned with wrong marks)."""
    got = next((i for i, s in enumerate(sizes) if s is None), len(sizes))
    if not got:
        return 0, 0
    k = np.frombuffer(b"".join(keys[:got]), dtype=np.uint8).reshape(got, KEY_BYTES)
    ok = (rows[:got, :KEY_BYTES] == k).all(axis=1) & (rows[:got, -_TAIL:] == k[:, :_TAIL]).all(axis=1)
    return (got if ok.all() else int(np.argmin(ok))), int((~ok).sum())


class _Rows:
    def __init__(self, block_bytes: int) -> None:
        self._a = np.zeros((256, block_bytes), dtype=np.uint8)

    def take(self, n: int) -> np.ndarray:
        if n > len(self._a):
            self._a = np.zeros((2 * n, self._a.shape[1]), dtype=np.uint8)
        return self._a[:n]


def serve(client: Client, keys: list[bytes], get_rows: _Rows, put_rows: _Rows) -> tuple[int, float, int, int]:
    """One request on one node: (verified hit blocks, lookup seconds, wrong blocks, failed calls)."""
    failed = wrong = 0
    t0 = time.perf_counter()
    try:
        n = client.lookup_prefix(NS, keys) if keys else 0
    except KVStoreError:
        n, failed = 0, 1
    lookup_s = time.perf_counter() - t0
    hit = 0
    if n:
        rows = get_rows.take(n)
        try:
            hit, wrong = _checked(rows, keys[:n], client.get_many_into(NS, keys[:n], list(rows)))
        except KVStoreError:
            failed += 1
    if hit < len(keys):
        todo = keys[hit:]
        rows = put_rows.take(len(todo))
        stamp(rows, todo)
        try:
            client.put_many(NS, todo, list(rows))
        except KVStoreError:
            failed += 1
    return hit, lookup_s, wrong, failed


def drive(requests: Sequence[Request], block_bytes: int, clients: dict[str, Client], route: Route, *,
          lock: threading.Lock | None = None, on_request: Callable[[int, float], None] | None = None,
          rate: float = 0.0) -> list[Record]:
    """Replay `requests` in order over `clients` (the live routing set, which churn changes under `lock`: held
    for each request); `on_request(i, t)` runs after each (churn's clock). `rate` > 0: request i is sent no
    earlier than i / rate seconds into the run (requests arrive at a rate, as at a serving cluster, so a churn
    event has the same seconds to recover in however fast this box replays); 0: back to back."""
    get_rows, put_rows = _Rows(block_bytes), _Rows(block_bytes)
    out: list[Record] = []
    start = time.perf_counter()
    for i, r in enumerate(requests):
        if rate > 0:
            wait = start + i / rate - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
        keys = chain_keys(r.cacheable_ids())
        with lock if lock is not None else contextlib.nullcontext():
            node = route(r, i, sorted(clients))
            hit, lookup_s, wrong, failed = serve(clients[node], keys, get_rows, put_rows)
        t = time.perf_counter() - start
        out.append(Record(t, node, len(keys), hit, lookup_s, wrong, failed))
        if on_request is not None:
            on_request(i, t)
    return out
