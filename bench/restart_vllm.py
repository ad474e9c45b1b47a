"""bench.restart's vLLM part: an agent load's TTFT through a real vLLM server while kvstore-server restarts.

bench.serve's model (its layers and dtype for this CPU) behind vLLM's OpenAI server with the connector. `n`
sessions each store a prompt of PROMPT tokens (one computed turn); then, per way of restarting, the restart is
started and at the same moment one pass of the sessions' next request runs (vLLM's own prefix cache reset before
each, so every cached token is the store's), and once the restart is over the same pass again (`after`: what
the new daemon serves; a request started with the restart may be answered by the old daemon while it drains).
Per way: the TTFT of each request (p50, max) and the fraction of the prompts served from the store, against
the same requests with every block in RAM (before any restart) and computed from scratch (the first turn).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import Any

import httpx

from bench.serve.http_client import complete, reset_prefix_cache
from bench.serve.model import cpu_dtype, write_model
from bench.serve.procs import ProcessSet
from bench.serve.run import default_layers
from bench.serve.servers import VllmSpec, kvstore_connector, start_vllm, wait_vllm
from kvstore.testing import DaemonProcess, wait_until

__all__ = ["ttft_across_restarts"]

PROMPT, OUT = 1536, 4
ORDER = ("hand-over", "disk-warm", "cold")  # cold last: it wipes the disk tier


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 8000 + 3 for i in range(n)]


async def _pass(url: str, prompts: list[list[int]], t0: float) -> list[tuple[float, float, int]]:
    """(seconds after t0 the request started, TTFT, cached tokens) of each prompt, one after another."""
    out = []
    async with httpx.AsyncClient(timeout=600.0) as http:
        for p in prompts:
            await reset_prefix_cache(http, url)
            start = time.monotonic() - t0
            c = await complete(http, url, p, OUT)
            out.append((start, c.ttft_s, c.cached_tokens))
    return out


def _summary(rows: list[tuple[float, float, int]]) -> dict[str, float]:
    ttft = sorted(r[1] for r in rows)
    return {"ttft_p50_s": round(ttft[len(ttft) // 2], 4), "ttft_max_s": round(ttft[-1], 4),
            "cached_fraction": round(sum(r[2] for r in rows) / (len(rows) * (PROMPT - 1)), 4),
            "requests": len(rows)}


def ttft_across_restarts(work: str, modes: list[str], quick: bool) -> dict[str, Any]:
    os.makedirs(work, exist_ok=True)
    dtype = cpu_dtype()
    layers = default_layers(dtype)
    model = write_model(os.path.join(work, "model"), layers, 2048)
    n = 2 if quick else 6
    kv = os.path.join(work, "kv")
    os.makedirs(kv, exist_ok=True)
    d = DaemonProcess(workdir=kv, arena_bytes="1GiB", max_block_bytes="8MiB", disk_bytes="4GiB",
                      disk_segment_bytes="64MiB", arena_lock="off", disk_write="commit")
    d.start(timeout_s=120)
    out: dict[str, Any] = {"sessions": n, "prompt_tokens": PROMPT, "layers": layers, "dtype": dtype}
    current = d
    try:
        with ProcessSet() as ps:
            spec = VllmSpec("restart-vllm", model, 2 * (2048 // 64), 2048, kvstore_connector(d.address),
                            extra_args=["--enforce-eager"], dtype=dtype)
            proc = start_vllm(spec, work)
            ps.add(proc)
            wait_vllm(proc, spec, timeout_s=1200)
            prompts = [_tokens(100 + s, PROMPT) for s in range(n)]
            out["recompute"] = _summary(asyncio.run(_pass(spec.url, prompts, time.monotonic())))
            with d.client() as c:
                wait_until(lambda: sum(x.blocks for x in c.stats().namespaces) >= n * (PROMPT // 64), 120,
                           what="the sessions saved")
                wait_until(lambda: c.stats().disk.blocks >= n * (PROMPT // 64), 300,  # type: ignore[union-attr]
                           what="the sessions on disk")
            out["ram"] = _summary(asyncio.run(_pass(spec.url, prompts, time.monotonic())))
            for mode in [m for m in ORDER if m in modes]:
                box: dict[str, Any] = {}

                def restart(mode: str = mode) -> None:
                    t = time.monotonic()
                    if mode == "hand-over":
                        box["new"] = current.successor(timeout_s=300)
                    else:
                        current.stop(signal.SIGTERM)
                        if mode == "cold":
                            current.args.append("--disk-wipe")
                        current.start(timeout_s=300)
                        if mode == "cold":
                            current.args.remove("--disk-wipe")
                    box["seconds"] = time.monotonic() - t

                t0 = time.monotonic()
                th = threading.Thread(target=restart)
                th.start()
                rows = asyncio.run(_pass(spec.url, prompts, t0))
                th.join(600)
                if "new" in box:
                    current = box["new"]
                    current.args = [a for a in current.args if a != "--take-over"]  # later: plain restarts
                # the same requests once the restart is over: what the new daemon serves (a request started
                # with the restart may still be answered by the old daemon while it drains)
                after = asyncio.run(_pass(spec.url, prompts, time.monotonic()))
                out[mode] = {**_summary(rows), "restart_s": round(box.get("seconds", -1.0), 3),
                             "per_request": [[round(a, 3), round(b, 4), c] for a, b, c in rows],
                             "after": {**_summary(after),
                                       "per_request": [[round(a, 3), round(b, 4), c] for a, b, c in after]}}
    finally:
        if current is not d:
            current.close()
        d.close()
    return out
