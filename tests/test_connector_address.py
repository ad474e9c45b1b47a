"""One address rule for the connector, the client and the CLI, and a connector that cannot reach its daemon.

The rule (kvstore/paths.py): $KVSTORE_ADDRESS, else the daemon's default socket ($XDG_RUNTIME_DIR/kvstore.sock,
else /tmp/kvstore-$UID/kvstore.sock), which is where a daemon started with its defaults listens. A link that
finds no daemon there warns once (WARNING, the address, how to set it), counts every failed connect, serves
without the store, and connects once a daemon answers.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore_connector.link import StoreLink
from kvstore.client import Client
from kvstore.paths import default_address, default_socket_path
from kvstore.server.config import load_config
from kvstore.testing import DaemonProcess, wait_until


def test_client_cli_connector_and_daemon_follow_one_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("KVSTORE_ADDRESS", raising=False)
    assert load_config([], {"XDG_RUNTIME_DIR": str(tmp_path)}).unix_socket == str(tmp_path / "kvstore.sock")
    assert default_socket_path() == str(tmp_path / "kvstore.sock")
    assert StoreLink(None, timeout_s=1.0).address == default_address() == f"unix:{tmp_path}/kvstore.sock"
    monkeypatch.setenv("KVSTORE_ADDRESS", "unix:/run/kvstore/kvstore.sock")
    assert StoreLink(None, timeout_s=1.0).address == "unix:/run/kvstore/kvstore.sock"
    assert StoreLink("/elsewhere.sock", timeout_s=1.0).address == "/elsewhere.sock"  # given: as given
    # the CLI dials the same address: its error names it
    r = subprocess.run([sys.executable, "-m", "kvstore.cli.main", "stats"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "KVSTORE_ADDRESS": f"unix:{tmp_path}/none.sock"})
    assert r.returncode != 0 and f"unix:{tmp_path}/none.sock" in r.stderr, r.stderr


def test_an_unreachable_daemon_is_reported_once_counted_and_retried(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    workdir = tmp_path / "d"
    workdir.mkdir(mode=0o700)
    address = f"unix:{workdir}/kvstore.sock"
    failures: list[int] = []
    link = StoreLink(address, timeout_s=2.0, retry_s=0.05, on_unreachable=lambda: failures.append(1))
    with caplog.at_level(logging.INFO, logger="kvstore_connector.link"):
        assert not link.connect()
        # later attempts (each after the pause; `client` tries again when it is over): counted, not logged
        wait_until(lambda: link.client is None and len(failures) >= 4, timeout_s=10, what="three retries")
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        text = warnings[0].getMessage()
        assert text.startswith(f"KVStoreConnector: no kvstore-server answers at {address} (")
        assert "set KVSTORE_ADDRESS (or kv_connector_extra_config.address)" in text
        assert link.call("ns", lambda c: c.echo()) is None  # serving without the store
        with DaemonProcess(workdir=str(workdir)) as d:
            assert d.address == address
            wait_until(lambda: link.client is not None, timeout_s=10, what="the link to connect")
            n = len(failures)
            assert link.call("ns", lambda c: c.put("ns", b"k", b"v")) is not None
            with Client(d.address) as c:
                assert c.get("ns", b"k") == b"v"
        assert len(failures) == n >= 4
    link.close()
