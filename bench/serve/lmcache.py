"""The peer to beat: LMCache 0.5.6's multiprocess server with vLLM's LMCacheMPConnector (shared-memory
transport), in its own venv (.venv-lmcache, `make setup-lmcache`): LMCache wants other versions of packages
than kvstore's venvs, and its in-process connector has no CPU path.

Settings that matter (checked on this machine): `--supported-transfer-mode engine_driven` (the default mode
does not serve this vLLM), `--eviction-policy LRU`, a unique `--shm-name` per run, metrics off (its exporter
needs a package it does not list), usage reporting off (no network).
"""

from __future__ import annotations

import os
import uuid

from bench.serve.procs import Proc, http_ok
from kvstore.testing import free_port

__all__ = ["LmcacheServer", "lmcache_venv"]


def lmcache_venv() -> str:
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.environ.get("KVSTORE_LMCACHE_VENV", os.path.join(here, ".venv-lmcache"))


class LmcacheServer:
    """`lmcache server` with an L1 (RAM) budget of `l1_gib` and 256-token chunks."""

    def __init__(self, log_dir: str, l1_gib: float, chunk_size: int = 256) -> None:
        venv = lmcache_venv()
        if not os.path.exists(os.path.join(venv, ".installed-stamp")):
            raise SystemExit(f"LMCache's venv {venv} is not set up: run `make setup-lmcache` (about 3 minutes)")
        self.python = os.path.join(venv, "bin", "python")
        self.port, self.http_port, self.prom_port = free_port(), free_port(), free_port()
        argv = [os.path.join(venv, "bin", "lmcache"), "server", "--host", "127.0.0.1", "--port", str(self.port),
                "--chunk-size", str(chunk_size), "--l1-size-gb", str(l1_gib), "--eviction-policy", "LRU",
                "--supported-transfer-mode", "engine_driven", "--shm-name", f"kvbench-{uuid.uuid4().hex[:8]}",
                "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
                "--prometheus-port", str(self.prom_port), "--disable-metrics"]
        env = {"LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = Proc("lmcache", argv, os.path.join(log_dir, "lmcache.log"), env)

    def start(self) -> LmcacheServer:
        self.proc.start().wait_ready(lambda: http_ok(f"http://127.0.0.1:{self.http_port}/healthcheck"), 120.0)
        return self

    def stop(self) -> None:
        self.proc.stop()

    def connector(self) -> dict[str, object]:
        return {"kv_connector": "LMCacheMPConnector",
                "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port}}
