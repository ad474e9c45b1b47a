"""Helpers of the hint tests over vLLM's OpenAI server (test_serve_hints_http.py, test_serve_release_http.py):
deterministic prompts, one greedy completion with ``kv_transfer_params``, and the daemon's hint counters read
with a deadline (hints run on the connector's background thread, so a test waits for them, never sleeps)."""

from __future__ import annotations

import time
from typing import Any

import httpx

from bench.serve.servers import SERVED_NAME
from kvstore.client import Client
from kvstore.hint_vocab import HINT_COUNTER_NAMES

__all__ = ["complete", "hint_counts", "tokens", "wait_counts"]


def tokens(seed: int, n: int) -> list[int]:
    """``n`` token ids, the same for the same seed (the bench model's vocabulary is 8192)."""
    return [(seed * 7919 + 31 * i) % 8000 + 3 for i in range(n)]


async def complete(http: httpx.AsyncClient, url: str, prompt: list[int], params: dict[str, Any] | None,
                   max_tokens: int = 8) -> tuple[int, tuple[int, ...]]:
    """(cached prompt tokens, generated ids) of one greedy completion, kv_transfer_params in the body."""
    body: dict[str, Any] = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": True, "return_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = params
    r = await http.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text[:500]
    js = r.json()
    ids = tuple(js["choices"][0]["token_ids"])
    assert len(ids) == max_tokens
    return int((js["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0), ids


def hint_counts(c: Client) -> dict[str, int]:
    """The daemon's nonzero ``hint_<action>_<outcome>`` counters."""
    counters = c.stats().counters
    return {k: counters.get(k, 0) for k in HINT_COUNTER_NAMES if counters.get(k, 0)}


def wait_counts(c: Client, want: dict[str, int], timeout_s: float = 60.0) -> dict[str, int]:
    """The daemon's nonzero hint counters once they reach ``want`` (or the deadline passes)."""
    deadline = time.monotonic() + timeout_s
    got = hint_counts(c)
    while got != want and time.monotonic() < deadline:
        time.sleep(0.05)
        got = hint_counts(c)
    return got
