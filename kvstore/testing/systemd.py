"""The two systemd protocols a daemon under systemd speaks, played by a test: sd_notify with the file descriptor
store, and sd_listen_fds at the next start.

Not a mock of the daemon's side: `FakeSystemd` is what systemd does with them. It binds a datagram socket and
gives its path as $NOTIFY_SOCKET; every message a daemon sends is parsed (READY=1, STOPPING=1, FDSTORE=1 with
FDNAME=..., FDSTOREREMOVE=1) and the descriptors it carries are kept by name, as systemd's store keeps them
(FileDescriptorStoreMax=). `launch` starts a process the way systemd starts the service's next instance:
the stored descriptors at 3, 4, ... with $LISTEN_FDS, $LISTEN_FDNAMES and $LISTEN_PID set to the new
process's own pid (a tiny exec wrapper sets that one, since systemd knows the pid only after fork).

What is not played: cgroups, restarts on failure, FileDescriptorStorePreserve=. A test kills and launches.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from typing import IO

__all__ = ["FakeSystemd"]

# in the new process: the passed descriptors moved to 3, 4, ... (via high numbers, so none is overwritten before it
# moves), $LISTEN_PID set to this pid, then exec the daemon
_WRAPPER = """
import fcntl, os, sys
src = [int(x) for x in os.environ.pop("KVSTORE_FAKE_SYSTEMD_FDS", "").split(",") if x]
high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for fd in src]
for fd in src:
    os.close(fd)
for i, fd in enumerate(high):
    os.dup2(fd, 3 + i)
    os.close(fd)
os.environ["LISTEN_PID"] = str(os.getpid())
os.execv(sys.argv[1], sys.argv[1:])
"""


class FakeSystemd:
    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="kvstore-systemd-")
        self.path = os.path.join(self._dir.name, "notify")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.path)
        self._lock = threading.Lock()
        self.store: dict[str, list[int]] = {}   # name -> descriptors, in the order they came
        self.messages: list[str] = []
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="fake-systemd", daemon=True)
        self._thread.start()

    @property
    def env(self) -> dict[str, str]:
        return {"NOTIFY_SOCKET": self.path}

    def _loop(self) -> None:
        while not self._stop:
            try:
                data, fds, _, _ = socket.recv_fds(self._sock, 4096, 16)
            except OSError:
                return
            text = data.decode(errors="replace")
            fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
            with self._lock:
                self.messages.append(text)
                name = fields.get("FDNAME", "stored")
                if fields.get("FDSTOREREMOVE") == "1":
                    for fd in self.store.pop(name, []):
                        os.close(fd)
                if fields.get("FDSTORE") == "1" and fds:
                    self.store.setdefault(name, []).extend(fds)
                else:
                    for fd in fds:
                        os.close(fd)

    def said(self, word: str) -> int:
        """How many messages carried `word` (e.g. 'READY=1')."""
        with self._lock:
            return sum(1 for m in self.messages if word in m.splitlines())

    def stored(self) -> dict[str, int]:
        """name -> one descriptor systemd holds under it (the first)."""
        with self._lock:
            return {name: fds[0] for name, fds in self.store.items() if fds}

    def launch(self, args: Sequence[str], env: dict[str, str] | None = None, log: IO[bytes] | None = None
               ) -> subprocess.Popen[bytes]:
        """Start `args` (args[0] an absolute executable) as systemd starts the next instance: the stored
        descriptors passed at 3.. with their names."""
        with self._lock:
            names, fds = [], []
            for name, held in self.store.items():
                for fd in held:
                    names.append(name)
                    fds.append(fd)
        full = {**os.environ, **(env or {}), **self.env, "LISTEN_FDS": str(len(fds)),
                "LISTEN_FDNAMES": ":".join(names), "KVSTORE_FAKE_SYSTEMD_FDS": ",".join(map(str, fds))}
        return subprocess.Popen([sys.executable, "-c", _WRAPPER, *args], env=full, stdout=log or subprocess.DEVNULL,
                                stderr=subprocess.STDOUT, pass_fds=fds)

    def close(self) -> None:
        self._stop = True
        self._sock.close()
        with self._lock:
            for held in self.store.values():
                for fd in held:
                    os.close(fd)
            self.store.clear()
        self._dir.cleanup()

    def __enter__(self) -> FakeSystemd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
