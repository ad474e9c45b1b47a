"""A module-scoped daemon per control path, for the modules that run every test over the fast path and gRPC."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvstore.testing import DaemonProcess

__all__ = ["per_path_daemon"]


def per_path_daemon(**options: object) -> Callable[..., Any]:
    """`daemon = per_path_daemon()` in a module: its `daemon` fixture starts once per `control_path` param."""
    opts = {"arena_bytes": "64MiB", "max_block_bytes": "4MiB", **options}

    @pytest.fixture(scope="module")
    def daemon(control_path: str) -> Iterator[DaemonProcess]:
        with DaemonProcess(**opts) as d:
            yield d

    return daemon
