"""Two tenants serving the same model on one daemon: each vLLM process saves and hits its own blocks, never the
other's, and both say the same tokens.

The daemon runs with a tokens file (alice, bob); each vLLM process (generate.py, a fresh process each) gets
its tenant's token through KVSTORE_TOKEN_FILE, as the pods of deploy/kubernetes/vllm-tenants.yaml do. The
connector names its namespaces after the tenant the daemon says its token belongs to
(vllm/<model>/<digest>/tenant=<tenant>), so bob's registration is not refused as "taken" by alice's.

Prompt of 300 tokens, block size 32: 9 full blocks and the tail block are stored (10 blocks); a repeat takes
299 tokens from the store. Bob's first request has exactly alice's prompt: a shared cache would serve it 299
tokens; it must get 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvstore.client import Client
from kvstore.testing import DaemonProcess

HERE = os.path.dirname(__file__)
TOKENS = {"alice": "alice-token-0123456789abcdef", "bob": "bob-token-0123456789abcdef"}


def _secret(path: str, text: str) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return path


def _generate(address: str, model_dir: str, token_file: str) -> list[dict]:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONHASHSEED": "random",
           "KVSTORE_TOKEN_FILE": token_file}
    r = subprocess.run([sys.executable, os.path.join(HERE, "generate.py"), "--address", address,
                        "--model-dir", model_dir], capture_output=True, text=True, timeout=900, env=env,
                       cwd=os.path.dirname(os.path.dirname(HERE)))
    assert r.returncode == 0, r.stderr[-6000:]
    assert "taken by another tenant" not in r.stderr, r.stderr[-6000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def _namespaces(address: str, token_file: str) -> dict[str, tuple[int, int, int]]:
    """name -> (blocks, puts, hit keys) of the namespaces this token sees (its own tenant's only)."""
    with Client(address, token_file=token_file) as c:
        return {n.name: (n.blocks, n.puts, n.hit_keys) for n in c.stats().namespaces}


def test_two_tenants_of_one_model_hit_their_own_blocks_and_never_each_others(tmp_path, model_dir) -> None:
    tokens_file = _secret(str(tmp_path / "tokens"), "".join(f"{t} {tok}\n" for t, tok in TOKENS.items()))
    files = {t: _secret(str(tmp_path / f"{t}.token"), tok + "\n") for t, tok in TOKENS.items()}
    with DaemonProcess(arena_bytes="256MiB", max_block_bytes="8MiB", tokens_file=tokens_file) as d:
        first_a, again_a = _generate(d.address, model_dir, files["alice"])
        first_b, again_b = _generate(d.address, model_dir, files["bob"])
        seen = {t: _namespaces(d.address, f) for t, f in files.items()}

    assert (first_a["num_cached_tokens"], again_a["num_cached_tokens"]) == (0, 299)  # alice hits her own
    assert (first_b["num_cached_tokens"], again_b["num_cached_tokens"]) == (0, 299)  # bob: none of alice's, his own
    assert first_a["tokens"] == again_a["tokens"] == first_b["tokens"] == again_b["tokens"]
    (name_a,), (name_b,) = seen["alice"], seen["bob"]
    assert name_a.endswith("/tenant=alice") and name_b.endswith("/tenant=bob")
    assert name_a.removesuffix("/tenant=alice") == name_b.removesuffix("/tenant=bob")  # same model, same layout
    # each stored its 10 blocks once; the hits were its own (2 per hit block: the scheduler's probe + the
    # worker's leased lookup, as in test_vllm_e2e.py's count)
    assert seen["alice"][name_a][:2] == seen["bob"][name_b][:2] == (10, 10)
    assert seen["alice"][name_a][2] == seen["bob"][name_b][2]
