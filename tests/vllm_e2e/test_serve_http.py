"""vLLM's real OpenAI server with KVStoreConnector, driven over HTTP as bench.serve drives it: one agent
session of three turns, each turn = the previous prompt + the tokens the model generated + a tool's output.
The server gets the README's short config, no module path: vLLM finds the connector through the plugin entry
point that installing kvstore registers (kvstore_connector/plugin.py).

vLLM's own prefix cache is reset before every turn, so every cached token came from the store. With
save="all" and one vLLM block per stored block (64 tokens), what a turn can hit is exact: everything vLLM
computed for the turn before (its prompt and all generated tokens but the last), its full blocks and the partial
one after them (kvstore_connector/tails.py), loaded into a block the turn's own new tokens then fill. A second server
without the connector runs the same session: the greedy tokens of every turn must be equal.
"""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.serve.http_client import complete, reset_prefix_cache
from bench.serve.model import write_model
from bench.serve.procs import ProcessSet
from bench.serve.servers import VllmSpec, kvstore_connector, start_vllm, wait_vllm
from kvstore.client import Client
from kvstore.testing import DaemonProcess, wait_until

SYSTEM, TOOL, OUT = 300, 100, 8


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 8000 + 3 for i in range(n)]


async def _session(url: str, reset: bool) -> list[tuple[int, int, tuple[int, ...]]]:
    """(prompt tokens, cached tokens, output ids) per turn."""
    out = []
    context = _tokens(1, SYSTEM)
    async with httpx.AsyncClient(timeout=600.0) as http:
        for turn in range(3):
            if turn:
                context += _tokens(turn + 1, TOOL)
            if reset:
                await reset_prefix_cache(http, url)
            c = await complete(http, url, context, OUT)
            out.append((c.prompt_tokens, c.cached_tokens, c.token_ids))
            context += list(c.token_ids)
    return out


def _kvstore_metrics(url: str) -> dict[tuple[str, str], float]:
    """The connector's counters on the server's own /metrics (kvstore_connector/prom.py): (name, family label value)
    -> value, for engine 0."""
    text = httpx.get(f"{url}/metrics", timeout=30.0).text
    return {(s.name, s.labels.get("tier") or s.labels.get("cause") or s.labels.get("outcome") or ""): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("vllm:kvstore_") and s.name.endswith("_total") and s.labels.get("engine") == "0"}


def test_three_turns_over_http_hit_the_store_and_match_vllm_alone(tmp_path) -> None:
    model = write_model(str(tmp_path / "model"), layers=2, max_len=2048)
    with DaemonProcess(arena_bytes="256MiB", max_block_bytes="8MiB") as d, ProcessSet() as ps:
        short = kvstore_connector(d.address, save="all", blocks_per_key=1)
        assert "kv_connector_module_path" not in short and short["kv_connector"] == "KVStoreConnector"
        specs = [VllmSpec("with-kvstore", model, 64, 2048, short, extra_args=["--enforce-eager"]),
                 VllmSpec("alone", model, 64, 2048, extra_args=["--enforce-eager"])]
        procs = [ps.add(start_vllm(s, str(tmp_path))) for s in specs]  # both boot at once
        for p, s in zip(procs, specs):
            wait_vllm(p, s, timeout_s=600)
        got = asyncio.run(_session(specs[0].url, reset=True))
        # vLLM's stat logger records the step that finished the last turn after its response: wait for it
        wait_until(lambda: _kvstore_metrics(specs[0].url).get(("vllm:kvstore_loaded_blocks_total", "")) == 5 + 7,
                   timeout_s=30.0, what="the connector's loaded blocks on /metrics")
        metrics = _kvstore_metrics(specs[0].url)
        want = asyncio.run(_session(specs[1].url, reset=False))
        with Client(d.address) as c:
            (ns,) = [n for n in c.stats().namespaces if n.name.startswith("vllm/")]
            blocks, hit_keys = ns.blocks, ns.hit_keys

    prompts = [SYSTEM, SYSTEM + OUT + TOOL, SYSTEM + 2 * (OUT + TOOL)]
    assert [g[0] for g in got] == prompts
    # computed before turn k: the previous prompt and all its generated tokens but the last
    computed = [0, prompts[0] + OUT - 1, prompts[1] + OUT - 1]
    assert [g[1] for g in got] == computed == [0, 307, 415]   # 4 and 6 full blocks, then tails of 51 and 31
    assert [g[2] for g in got] == [w[2] for w in want]  # identical greedy tokens, turn by turn
    # each hit is counted twice: by the scheduler's probes (prefix, then tail) and by the worker's leased Lookup
    assert hit_keys == 2 * (5 + 7)
    # stored: every full block vLLM computed over the session (turn 2's prompt + 7 generated: 523 -> 8 blocks)
    # and each turn's tail, saved in the step that sampled its last token
    assert blocks == (prompts[2] + OUT - 1) // 64 + 3
    # vLLM's /metrics lists the connector's counters: every hit token came from the store's RAM
    served = {tier: metrics[("vllm:kvstore_served_tokens_total", tier)] for tier in ("ram", "disk", "peer")}
    assert served == {"ram": 307 + 415, "disk": 0, "peer": 0}
    assert metrics[("vllm:kvstore_hit_tokens_total", "")] == 256 + 384              # full blocks
    assert (metrics[("vllm:kvstore_tail_hit_tokens_total", "")], metrics[("vllm:kvstore_tail_saves_total", "")]) == (
        51 + 31, 3)
    assert ("vllm:kvstore_misses_total", "never_stored") in metrics
    # the time vLLM's threads spent in the connector's hooks (kvstore_connector/stats.py timed): some, and far less than
    # the three turns took (bench.serve's no-reuse rounds divide it by the server's time)
    hooks = [metrics[(f"vllm:kvstore_{side}_hook_seconds_total", "")] for side in ("scheduler", "worker")]
    assert all(0 < h < 5.0 for h in hooks), hooks
