"""A real model through vLLM on CPU with KVStoreConnector and a real daemon, end to end.

Prompt of 300 tokens, block size 32: 9 full blocks (288 tokens) and the block of the last 12 (its tail,
kvstore_connector/tails.py) are stored; vLLM computes at least the last token itself, so a repeat takes 299 tokens from
the store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvstore.client import Client

HERE = os.path.dirname(__file__)


def _generate(address: str, model_dir: str, *extra: str) -> list[dict]:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONHASHSEED": "random"}
    r = subprocess.run([sys.executable, os.path.join(HERE, "generate.py"), "--address", address,
                        "--model-dir", model_dir, *extra], capture_output=True, text=True, timeout=900, env=env,
                       cwd=os.path.dirname(os.path.dirname(HERE)))
    assert r.returncode == 0, r.stderr[-6000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def _stats(address: str) -> dict[str, int]:
    with Client(address) as c:
        (ns,) = [n for n in c.stats().namespaces if n.name.startswith("vllm/")]
        return {"blocks": ns.blocks, "puts": ns.puts, "hit_keys": ns.hit_keys}


def test_store_hits_across_reset_and_across_processes_and_the_path_is_real(daemon, model_dir) -> None:
    first, again = _generate(daemon.address, model_dir)
    assert first["num_cached_tokens"] == 0
    assert again["num_cached_tokens"] == 299                   # vLLM's cache was reset: these came from us
    assert again["tokens"] == first["tokens"]                  # identical greedy output from loaded KV
    s = _stats(daemon.address)
    assert (s["blocks"], s["puts"]) == (10, 10)

    # A second vLLM in a new process (another random NONE_HASH): its very first request hits the store.
    fresh, _ = _generate(daemon.address, model_dir)
    assert fresh["num_cached_tokens"] == 299 and fresh["tokens"] == first["tokens"]
    assert _stats(daemon.address)["puts"] == 10                # nothing stored twice

    # Corrupt every stored block: a load of those bytes must change what the model says.
    base, corrupted, after = _generate(daemon.address, model_dir, "--corrupt")
    assert base["tokens"] == first["tokens"] and corrupted == {"corrupted": 10}
    assert after["num_cached_tokens"] == 299
    assert after["tokens"] != first["tokens"]
