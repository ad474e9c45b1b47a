"""Start and stop a real kvstore-server process: used by the tests, the benchmarks and the demo.

Not a fake: it runs the real daemon (`python -m kvstore.server.main`) on a free loopback port and a private
unix socket with its own arena name, waits for Health by polling with a deadline, and on exit stops it with
SIGTERM (or leaves a SIGKILLed one for the caller to inspect).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from types import TracebackType
from typing import IO, Any

import grpc

from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client import Client
from kvstore.errors import StoreUnavailableError, UnauthenticatedError

__all__ = ["DaemonProcess", "free_port", "wait_until", "raw_stub"]


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as fh:
            lo, hi = (int(x) for x in fh.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


# Every port free_port handed out in this process: never handed twice. A daemon binds its ports only when it
# starts, so two picks for one daemon (its gRPC, metrics and peer ports) could otherwise draw the same free
# port (seen in CI: metrics and peer_listen both given 27529, the daemon exited "address already in use").
_HANDED: set[int] = set()


def free_port() -> int:
    """A loopback TCP port that is free now, picked at random BELOW the kernel's ephemeral range.

    Why not bind(0): that hands out an ephemeral port, and between our close and the daemon's bind any
    outgoing connection on the box (a gRPC channel, etcd's own clients) may be given the same port, which
    fails the daemon with "address in use". Ports under the ephemeral range are only taken by explicit binds."""
    lo, _ = _ephemeral_range()
    top = max(lo - 1, 10_000)
    rng = random.Random()
    for _ in range(200):
        port = rng.randint(max(1024, top - 10_000), top)
        if port in _HANDED:   # free now, but handed to a daemon that has not bound it yet (or one alive)
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:   # a crowded box: fall back to the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw_stub(address: str) -> tuple[grpc.Channel, pb_grpc.KVStoreStub]:
    """A bare gRPC stub, to check exact status codes without the client's translation."""
    ch = grpc.insecure_channel(address)
    return ch, pb_grpc.KVStoreStub(ch)


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.02, what: str = "condition") -> None:
    """Poll `predicate` until it is truthy; AssertionError naming `what` after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


class DaemonProcess:
    """`with DaemonProcess(arena_bytes="64MiB") as d: Client(d.address)`; options map to --flags."""

    def __init__(self, *, workdir: str | None = None, extra_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 **options: object) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="kvstore-test-") if workdir is None else None
        self.workdir = workdir or self._tmp.name  # type: ignore[union-attr]  # _tmp is made when workdir is None
        self.port = free_port()
        self.metrics_port = free_port()
        while self.metrics_port == self.port:  # both are only free, not bound, until the daemon binds them
            self.metrics_port = free_port()
        self.node_id = str(options.pop("node_id", f"t{uuid.uuid4().hex[:10]}"))
        self.arena_name = str(options.pop("arena_name", f"/kvstore-{self.node_id}"))
        self.socket_path = os.path.join(self.workdir, "kvstore.sock")
        self.log_path = os.path.join(self.workdir, "daemon.log")
        opts: dict[str, object] = {"node_id": self.node_id, "arena_name": self.arena_name,
                                   "unix_socket": self.socket_path, "listen": f"127.0.0.1:{self.port}",
                                   "arena_bytes": "64MiB", "max_block_bytes": "4MiB", "arena_lock": "off",
                                   # RAM-only unless a test asks for the disk tier (then it lives in workdir)
                                   "disk_bytes": 0, "disk_dir": os.path.join(self.workdir, "disk"),
                                   "metrics_listen": f"127.0.0.1:{self.metrics_port}"}
        opts.update(options)
        self.args = [sys.executable, "-m", "kvstore.server.main"]
        for k, v in opts.items():
            if v is True:
                self.args.append("--" + k.replace("_", "-"))  # a switch such as --disk-wipe
            elif v is not False:
                self.args += ["--" + k.replace("_", "-"), str(v)]
        self.args += list(extra_args)
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def address(self) -> str:
        return "unix:" + self.socket_path

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    @property
    def tcp_address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0, launcher: Any = None) -> DaemonProcess:
        """Start and wait for Health; on any failure the process is stopped before the error propagates.
        `launcher(args, env, log)` -> Popen starts the process instead (kvstore.testing.systemd.FakeSystemd)."""
        self._log = open(self.log_path, "ab")
        if launcher is not None:
            self.proc = launcher(self.args, self.env, self._log)
        else:
            self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        try:
            return self._wait_ready(timeout_s)
        except BaseException:
            self.stop(signal.SIGKILL)
            raise

    def _wait_ready(self, timeout_s: float) -> DaemonProcess:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvstore-server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with Client(self.address, timeout_s=1.0, token_file=""):
                    return self
            except UnauthenticatedError:  # tokens are on: the daemon answered, so it is ready
                return self
            except StoreUnavailableError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kvstore-server not ready after {timeout_s}s:\n{self.log()}") from None
                time.sleep(0.05)

    def successor(self, env: dict[str, str] | None = None, extra_args: Sequence[str] = (),
                  wait: bool = True, timeout_s: float = 60.0) -> DaemonProcess:
        """A second process started beside this one with the same options and `--take-over` (a hand-over
        restart): the returned object shares this one's paths and ports and logs to `successor-N.log`. With
        `wait`, returns once this process has exited and the successor answers (RuntimeError otherwise)."""
        twin = DaemonProcess.__new__(DaemonProcess)
        twin.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("proc", "_log", "_tmp")})
        twin._tmp = None  # the original owns the directory
        n = sum(1 for f in os.listdir(self.workdir) if f.startswith("successor-"))
        twin.log_path = os.path.join(self.workdir, f"successor-{n}.log")
        twin.args = [a for a in self.args if a != "--take-over"] + list(extra_args) + ["--take-over"]
        twin.env = {**self.env, **(env or {})}
        twin._log = open(twin.log_path, "ab")
        twin.proc = subprocess.Popen(twin.args, stdout=twin._log, stderr=subprocess.STDOUT, env=twin.env)
        if wait:
            deadline = time.monotonic() + timeout_s
            while self.proc is not None and self.proc.poll() is None:
                if twin.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"hand-over did not finish:\n{self.log()}\n--- successor:\n{twin.log()}")
                time.sleep(0.02)
            twin._wait_ready(max(1.0, deadline - time.monotonic()))
        return twin

    def log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return fh.read()
        except OSError:
            return ""

    def client(self, **kw: Any) -> Client:
        """A Client of this daemon; `kw` are Client's own keyword options, passed through."""
        return Client(self.address, **kw)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def close(self) -> None:
        self.stop()
        if self._log is not None and not self._log.closed:
            self._log.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
