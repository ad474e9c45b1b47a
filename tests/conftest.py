"""Shared fixtures: real daemons (subprocesses on free ports, private sockets and arenas)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

from kvstore.testing import DaemonProcess
from tests.required import missing

# The vLLM suites run in their own environments (`make test-vllm`); the main environment has no vLLM.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_sched", "vllm_e2e"]
# The install path runs against a venv built from the wheel (`make test-install` names it).
if not os.environ.get("KVSTORE_WHEEL_VENV"):
    collect_ignore.append("install")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "needs(present, what, install): a real component the test needs "
                            "(tests/required.py): skipped when missing, failed under KVSTORE_REQUIRE_ALL=1")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """An unmet `needs` mark: skip, or under KVSTORE_REQUIRE_ALL=1 (CI) fail with how to install it."""
    for mark in item.iter_markers("needs"):
        if not mark.kwargs["present"]:
            missing(mark.kwargs["what"], mark.kwargs["install"])


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    """One daemon per test module (64 MiB arena, 4 MiB blocks); tests use their own namespaces."""
    with DaemonProcess(arena_bytes="64MiB", max_block_bytes="4MiB") as d:
        yield d


@pytest.fixture
def make_daemon() -> Iterator:
    """Factory for daemons with custom options; all are stopped at the end of the test."""
    started: list[DaemonProcess] = []

    def make(**options: object) -> DaemonProcess:
        d = DaemonProcess(**options)
        started.append(d)
        return d.start()

    yield make
    for d in started:
        d.close()


@pytest.fixture(scope="module", params=["fast", "grpc"])
def control_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a module once per control path: every Client (also in subprocesses, which inherit the environment)
    reads KVSTORE_CONTROL. Modules opt in with `pytestmark = pytest.mark.usefixtures("control_path")` and, when
    they use the shared `daemon`, `daemon = per_path_daemon()` (tests/control_paths.py) so that each path gets
    a daemon of its own (the tests store fixed keys)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("KVSTORE_CONTROL", request.param)
    yield str(request.param)
    mp.undo()
