"""`kvstore explain --session` after vLLM 0.33's real v1 Scheduler (CPU) ran a session's requests with a real
daemon: a request naming its session in kv_transfer_params ("kvstore_session", as the OpenAI server passes it in
SamplingParams.extra_args) and carrying no hint at all is noted in the daemon's session book when it finishes
(kvstore_connector/hints.py), so the CLI answers the exact keys the connector stored for it, block by block.

blocks_per_key=1, block size 16: a 100-token prompt stores 6 blocks, a 132-token one 8.
"""

from __future__ import annotations

import json

import pytest

from kvstore_connector.namespace import namespace_for
from kvstore.cli.main import main
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from .harness import SAMPLED, Harness, Tracked
from .stored import PROMPT, chain_keys


def add(h: Harness, rid: str, prompt: list[int], params: dict) -> Request:
    sp = SamplingParams(max_tokens=2, ignore_eos=True, extra_args={"kv_transfer_params": params})
    req = Request(rid, prompt, sp, None, block_hasher=h._hasher)
    h.scheduler.add_request(req)
    h.tracked[rid] = Tracked(req)
    return req


def note_counts(h: Harness) -> dict[str, float]:
    sched = h.sched_side._sched
    assert sched is not None and sched.hints.flush(20.0), "the hint thread did not finish its queue in 20 s"
    return {k: v for k, v in h.sched_side.counters.totals.items() if k.startswith(("session_", "hint_"))}


def explain(address: str, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["--address", address, "explain", *args])
    out, err = capsys.readouterr()
    assert err == ""
    return rc, out


def test_explain_session_answers_the_keys_vllm_stored_for_the_session(daemon, model_dir, capsys) -> None:
    h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1})
    ns = namespace_for(h.sched_side.spec)
    r1 = add(h, "turn1", PROMPT, {"kvstore_session": "agent-7"})
    h.run()
    assert list(r1.output_token_ids) == [SAMPLED, SAMPLED] and h.tracked["turn1"].scheduled_tokens == 101
    assert note_counts(h) == {"session_noted": 1}
    rc, out = explain(daemon.address, capsys, "--json", "--session", "agent-7")
    assert rc == 0
    [entry] = json.loads(out)["entries"]
    assert (entry["namespace"], entry["ended"], entry["tokens_per_block"]) == (ns, False, 16)
    assert [b["key"] for b in entry["blocks"]] == [k.hex() for k in chain_keys(6, PROMPT)]
    assert [(b["tier"], b["cause"]) for b in entry["blocks"]] == [("ram", None)] * 6
    assert [b["tokens"] for b in entry["blocks"]] == [[16 * i, 16 * (i + 1)] for i in range(6)]
    # the next turn of the session extends its prompt: its 8 stored keys replace the chain
    turn2 = PROMPT + [(7 * i + 5) % 1000 + 10 for i in range(32)]
    add(h, "turn2", turn2, {"kvstore_session": "agent-7"})
    h.run()
    assert note_counts(h) == {"session_noted": 2}
    rc, out = explain(daemon.address, capsys, ns, "--session", "agent-7")
    assert rc == 0 and f"{ns}: session agent-7 (live, noted " in out
    assert out.rstrip().splitlines()[-1] == ("8 block(s): ram 8, disk 0, missing 0; misses by cause: none; a prefix "
                                             "Lookup hits the first 8 of 8 (128 tokens); no miss")
    rc, out = explain(daemon.address, capsys, "--json", "--session", "agent-7")
    assert [b["key"] for b in json.loads(out)["entries"][0]["blocks"]] == [k.hex() for k in chain_keys(8, turn2)]
    # the orchestrator ends the session: its 8 blocks released, the entry kept and marked ended
    add(h, "end", [1, 2, 3], {"kvstore_hints": [{"action": "release", "session": "agent-7"}]})
    h.run()
    assert note_counts(h) == {"session_noted": 3, "hint_accepted": 8}
    rc, out = explain(daemon.address, capsys, "--json", "--session", "agent-7")
    [entry] = json.loads(out)["entries"]
    assert entry["ended"] is True and len(entry["blocks"]) == 8
    h.close()
