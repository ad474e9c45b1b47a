"""Child processes of a benchmark run: each in its own process group with its log in a file, started with a
health wait that fails fast (the process exited: its log tail is in the error), and stopped for sure.

Why process groups: vLLM's API server forks its engine core, LMCache its workers. Stopping only the parent
would leave them holding memory and ports, and a Ctrl-C or a failed configuration must not leave a node with
orphaned servers. `ProcessSet` stops everything it started, in reverse order, whatever happened.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Protocol

__all__ = ["Proc", "ProcessSet", "Stoppable", "http_ok", "log_tail"]


class Stoppable(Protocol):
    def stop(self) -> object: ...


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return 200 <= r.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def log_tail(path: str, n: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class Proc:
    """One child: `argv` with `env`, stdout and stderr to `log_path`, in a new session (its own group)."""

    def __init__(self, name: str, argv: Sequence[str], log_path: str, env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.log_path = name, list(argv), log_path
        self.env = {**os.environ, **(env or {})}
        self.popen: subprocess.Popen[bytes] | None = None
        self.started_s = 0.0
        self.ready_s = float("nan")  # seconds from start to healthy

    def start(self) -> Proc:
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                          start_new_session=True)
        self.started_s = time.monotonic()
        return self

    def wait_ready(self, ready: Callable[[], bool], timeout_s: float) -> Proc:
        """Poll `ready` until it holds; RuntimeError with the log's tail when the process exits or time runs out."""
        assert self.popen is not None, "start() first"
        deadline = self.started_s + timeout_s
        while not ready():
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode} before it was ready; "
                                   f"log {self.log_path}:\n{log_tail(self.log_path)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s; log {self.log_path}:\n"
                                   f"{log_tail(self.log_path)}")
            time.sleep(0.5)
        self.ready_s = time.monotonic() - self.started_s
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the whole group, SIGKILL after `grace_s`; idempotent."""
        p = self.popen
        if p is None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # children that outlived their leader (the group may still hold them)
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen = None


class ProcessSet:
    """Everything a run started; `with ProcessSet() as ps:` stops all of it on exit, Ctrl-C included."""

    def __init__(self) -> None:
        self.procs: list[Stoppable] = []

    def add(self, proc: Stoppable) -> Stoppable:
        self.procs.append(proc)
        return proc

    def stop(self, proc: Stoppable) -> None:
        proc.stop()
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        while self.procs:
            self.procs.pop().stop()

    def __enter__(self) -> ProcessSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
