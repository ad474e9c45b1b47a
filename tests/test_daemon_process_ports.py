"""DaemonProcess never gives its daemon the same port for gRPC and metrics: free_port only checks that a port is
free now, so two calls can return the same one, and the daemon then fails to listen on the second ("address in
use": a clean-clone CI run lost three tests to it)."""

from __future__ import annotations

import pytest

import kvstore.testing.daemon as daemon_mod
from kvstore.testing import DaemonProcess


def test_the_metrics_port_is_drawn_again_while_it_equals_the_grpc_port(monkeypatch: pytest.MonkeyPatch) -> None:
    drawn = iter([23001, 23001, 23001, 23002])
    monkeypatch.setattr(daemon_mod, "free_port", lambda: next(drawn))
    d = DaemonProcess()
    assert (d.port, d.metrics_port) == (23001, 23002)
    assert next(drawn, None) is None  # exactly four draws
