"""Shared fixtures: real daemons (subprocesses on free ports, private sockets and arenas)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvstore.testing import DaemonProcess


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
