"""One streamed completion over vLLM's OpenAI API: time to first token, the generated token ids, and how many
prompt tokens the server reported as cached (its own prefix cache plus the KV connector's hits).

Prompts go as token ids (`--skip-tokenizer-init`: no tokenizer needed) with `return_token_ids`, greedy,
`ignore_eos` so every configuration generates exactly the planned number of tokens. TTFT is taken at the first
streamed chunk that carries a token, as a user's client sees it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

from bench.serve.servers import SERVED_NAME

__all__ = ["Completion", "complete", "reset_prefix_cache"]


@dataclass(frozen=True)
class Completion:
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    token_ids: tuple[int, ...]


async def complete(http: httpx.AsyncClient, base_url: str, prompt: list[int], max_tokens: int) -> Completion:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    t0 = time.perf_counter()
    ttft = None
    tokens: list[int] = []
    usage: dict | None = None
    async with http.stream("POST", base_url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            raise RuntimeError(f"{base_url}: HTTP {r.status_code}: {text[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                ids = choice.get("token_ids") or ()
                if ids and ttft is None:
                    ttft = time.perf_counter() - t0
                tokens.extend(ids)
            if chunk.get("usage"):
                usage = chunk["usage"]
    total = time.perf_counter() - t0
    if ttft is None or usage is None:
        raise RuntimeError(f"{base_url}: the stream carried no token or no usage chunk")
    if len(tokens) != max_tokens:
        raise RuntimeError(f"{base_url}: asked for {max_tokens} tokens (ignore_eos), got {len(tokens)}")
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return Completion(ttft, total, int(usage["prompt_tokens"]), cached, tuple(tokens))


async def reset_prefix_cache(http: httpx.AsyncClient, base_url: str, tries: int = 60) -> None:
    """Empty vLLM's own prefix cache (not the connector's store). It refuses while blocks are still held (a
    connector's asynchronous save, a request finishing); retried until it succeeds."""
    import asyncio

    for _ in range(tries):
        if _reset_ok(await http.post(base_url + "/reset_prefix_cache")):
            return
        # an idle engine must take a step to finish pending saves: a one-token request makes it step
        await http.post(base_url + "/v1/completions", json={"model": SERVED_NAME, "prompt": [5], "max_tokens": 1})
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{base_url}: /reset_prefix_cache kept failing")


def _reset_ok(r: httpx.Response) -> bool:
    """vLLM answers 200 with an empty body, null, true, or {"success": bool}, depending on the release."""
    if r.status_code != 200:
        return False
    if r.text.strip() in ("", "null"):
        return True
    body = r.json()
    return body is True or (isinstance(body, dict) and bool(body.get("success", True)))
