"""A real etcd process on free loopback ports, and peer daemons that join it (tests and bench.remote).

`EtcdProcess` runs /usr/bin/etcd (Debian's etcd-server) with a temporary data directory; `stop()` and
`start()` again keep the same ports and data, so a test can take etcd away and bring it back. `peer_options`
are the DaemonProcess options that make a daemon join it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.request
from types import TracebackType
from typing import Self

from kvstore.testing.daemon import free_port

__all__ = ["EtcdProcess", "etcd_binary", "peer_options"]


def etcd_binary() -> str | None:
    """The etcd server binary, or None when it is not installed (apt-get install etcd-server)."""
    return shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)


class EtcdProcess:
    def __init__(self) -> None:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("etcd is not installed: apt-get install -y etcd-server")
        self._binary = binary
        self._tmp = tempfile.TemporaryDirectory(prefix="kvstore-etcd-")
        self.client_port, self.peer_port = free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    # hooks a subclass overrides (tests/etcd_secure.py: TLS, client certificates, auth), start() stays one
    def _name(self) -> str:
        return "kvstore-test"

    def _listen_client_url(self) -> str:
        return self.endpoint

    def _extra_args(self) -> list[str]:
        return []

    def _health_context(self) -> ssl.SSLContext | None:
        return None

    def start(self, timeout_s: float = 15.0) -> Self:
        peer = f"http://127.0.0.1:{self.peer_port}"
        name = self._name()
        args = [self._binary, "--name", name, "--data-dir", os.path.join(self._tmp.name, "data"),
                "--listen-client-urls", self._listen_client_url(), "--advertise-client-urls", self.endpoint,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"{name}={peer}", "--log-level", "error", *self._extra_args()]
        log = open(os.path.join(self._tmp.name, "etcd.log"), "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log()}")
            try:
                with urllib.request.urlopen(self.endpoint + "/health", timeout=0.5,
                                            context=self._health_context()) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd not healthy after {timeout_s}s: {self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        try:
            with open(os.path.join(self._tmp.name, "etcd.log"), errors="replace") as fh:
                return fh.read()[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def close(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def peer_options(etcd: EtcdProcess, *, plane: str = "tcp", ttl_s: float = 2.0, timeout_s: float = 1.0,
                 replication: str = "owner", prefix: str = "/kvstore/members/", **extra: object) -> dict[str, object]:
    """DaemonProcess options for a daemon that joins `etcd` with its own data port."""
    opts: dict[str, object] = {
        "etcd_endpoints": etcd.endpoint, "etcd_prefix": prefix, "peer_listen": f"127.0.0.1:{free_port()}",
        "peer_lease_ttl_s": ttl_s, "peer_refresh_s": min(0.2, ttl_s / 3), "peer_timeout_s": timeout_s,
        "peer_replication": replication, "peer_data_plane": plane,
    }
    opts.update(extra)
    return opts
