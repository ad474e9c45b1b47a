"""An MLA model (tiny DeepSeek-V2, tests/vllm_e2e/mla_models.py) through vLLM on CPU with KVStoreConnector and a
real daemon, end to end.

vLLM's CPU platform cannot compute MLA on top of cached KV (it turns its own prefix caching off for MLA), so the
connector offers no hits there and only saves (kvstore_connector/vllm_connector.py). What must hold: it says so in the
log, the store receives the prompt's 37 full blocks of 16 tokens and its 8-token tail (vLLM's page: one 576-value
float32 latent per token per layer, 36,864 B; 73,728 B a stored block for the 2 layers), nothing is looked up or
loaded, and after reset_prefix_cache the same prompt is computed again from scratch with greedy tokens identical
to a vLLM without the connector. The two vLLMs run as two processes at the same time (~25 s each here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvstore.client import Client
from tests.vllm_e2e.mla_models import (BLOCK_SIZE, LAYERS, MAX_TOKENS, NO_HITS_LOG, PAGE_BYTES, PROMPT_LEN,
                                       write_model)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCKS = PROMPT_LEN // BLOCK_SIZE      # 37 full blocks of the 600-token prompt
BLOCK_BYTES = LAYERS * PAGE_BYTES      # 73,728 B: both layers' pages in one stored value (blocks_per_key 1)


def _start(model_dir: str, log: Path, address: str | None = None) -> subprocess.Popen:
    """mla_models.py in a fresh process; stdout and stderr go to ``log``.out/.err (files: two runs at once never
    block on a full pipe)."""
    cmd = [sys.executable, "-m", "tests.vllm_e2e.mla_models", model_dir] + (["--address", address] if address else [])
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONHASHSEED": "random"}
    with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
        return subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=ROOT)


def _finish(p: subprocess.Popen, log: Path) -> tuple[list[dict], str]:
    """(the JSON lines, the log) of a finished run; fails with its output's tail when it did not exit 0."""
    p.wait(timeout=600)
    out, err = Path(f"{log}.out").read_text(), Path(f"{log}.err").read_text()
    assert p.returncode == 0, (out + err)[-6000:]
    # the log: the connector's lines go where vLLM's go (kvstore_connector/vllm_logs.py: stdout unless
    # VLLM_LOGGING_STREAM says otherwise), Python's own warnings to stderr
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")], out + err


def test_mla_on_cpu_saves_the_prompt_and_offers_no_hits(daemon, tmp_path) -> None:
    model = write_model(str(tmp_path / "dsv2-mla"))
    logs = tmp_path / "with-connector", tmp_path / "without"
    with_connector, without = _start(model, logs[0], daemon.address), _start(model, logs[1])
    try:
        (info, first, again), err = _finish(with_connector, logs[0])
        (ref_info, ref), _ = _finish(without, logs[1])
    finally:
        for p in (with_connector, without):
            if p.poll() is None:
                p.kill()
                p.wait()

    mla = [{"kind": "MLAAttentionSpec", "block_size": BLOCK_SIZE, "page_size_bytes": PAGE_BYTES, "layers": LAYERS}]
    assert info == ref_info == {"use_mla": True, "prefix_caching": False, "groups": mla}
    assert ref["num_cached_tokens"] == 0 and len(ref["tokens"]) == MAX_TOKENS
    assert len(set(ref["tokens"])) > 3, ref          # the output depends on the context (see mla_models.py)
    assert err.count(NO_HITS_LOG) == 1, err[-4000:]  # the scheduler side says it once

    # The first request: computed, and its 37 full blocks saved, then the block of its last 8 prompt tokens
    # under their tail key (kvstore_connector/tails.py), with the prompt's last token: 38 stored blocks.
    assert first["num_cached_tokens"] == 0 and first["tokens"] == ref["tokens"]
    sched, worker = first["counters"]["scheduler"], first["counters"]["worker"]
    assert (sched["save_keys"], sched["tail_saves"]) == (BLOCKS, 1)
    assert (worker["saved_blocks"], worker["saved_bytes"], worker["save_skipped_blocks"]) == \
           (BLOCKS + 1, (BLOCKS + 1) * BLOCK_BYTES, 0)
    with Client(daemon.address) as c:
        (ns,) = [n for n in c.stats().namespaces if n.name.startswith("vllm/")]
    assert (ns.blocks, ns.bytes, ns.puts, ns.tokens_per_block) == (BLOCKS + 1, (BLOCKS + 1) * BLOCK_BYTES, BLOCKS + 1,
                                                                   BLOCK_SIZE)
    assert (ns.lookup_keys, ns.hit_keys) == (0, 0)  # no hits offered: the scheduler did not even look

    # After vLLM's reset the same prompt: no external hit tokens, nothing loaded, computed again from scratch,
    # the same greedy tokens; its blocks are already stored, so the save skips all 38.
    assert again["num_cached_tokens"] == 0 and again["tokens"] == ref["tokens"]
    sched, worker = again["counters"]["scheduler"], again["counters"]["worker"]
    assert (sched.get("hit_tokens", 0), sched.get("lookup_tokens", 0), sched.get("load_requests", 0)) == (0, 0, 0)
    assert (worker.get("loaded_blocks", 0), worker.get("loaded_bytes", 0)) == (0, 0)
    assert (sched["save_keys"], sched["tail_saves"]) == (2 * BLOCKS, 2)
    assert (worker["saved_blocks"], worker["save_skipped_blocks"]) == (BLOCKS + 1, BLOCKS + 1)
    with Client(daemon.address) as c:
        (ns,) = [n for n in c.stats().namespaces if n.name.startswith("vllm/")]
    assert (ns.blocks, ns.puts, ns.lookup_keys, ns.hit_keys) == (BLOCKS + 1, BLOCKS + 1, 0, 0)
    print(f"MLA on CPU: {BLOCKS} blocks x {BLOCK_BYTES:,} B = {BLOCKS * BLOCK_BYTES:,} B stored, 0 hit tokens, "
          f"tokens {ref['tokens']}")
