"""Reloading the tokens file while the daemon runs: rotation and revocation without a restart.

The file is re-read when it changes (checked from the sweeper at most once a second: inode, size and mtime, so
an editor's rename-over and a Kubernetes secret update are both seen) and on SIGHUP. The new table replaces the
old one in the interceptor in one assignment, so each call is checked against one whole table. A file that no
longer passes the startup checks (mode, format, no tokens) is NOT applied: the daemon logs why and keeps
serving with the tokens it had, so a typo cannot lock every client out or open the daemon up.

Revocation applies to new calls: a Subscribe stream opened with a removed token runs until it ends. The
same-node socket's connections opened with a removed token are closed at once (FastServer.drop_revoked),
idle or not, so a client that answers probes from its key index learns of it before its next answer.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from kvstore.errors import ConfigError
from kvstore.security.tokens import TokenTable
from kvstore.server.auth import AuthInterceptor

__all__ = ["TokenWatcher"]

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0


def _signature(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class TokenWatcher:
    def __init__(self, path: str, interceptor: AuthInterceptor) -> None:
        self._path = path
        self._interceptor = interceptor
        self.on_reload: list[Callable[[], None]] = []  # told after each table applied (the fast socket's drop)
        self._seen = _signature(path)
        self._next_check = 0.0
        self._requested = threading.Event()
        self.reloads = 0          # tables applied since start
        self.failures = 0         # reloads refused (file unreadable or invalid)

    def request(self) -> None:
        """Ask for a reload at the next poll (safe from a signal handler: sets an event, nothing else)."""
        self._requested.set()

    def poll(self) -> None:
        """Reload if asked to, or if the file changed since the last look (sweeper thread)."""
        now = time.monotonic()
        if not self._requested.is_set() and now < self._next_check:
            return
        self._next_check = now + CHECK_INTERVAL_S
        sig = _signature(self._path)
        if self._requested.is_set() or sig != self._seen:
            self._requested.clear()
            self._seen = sig
            self.reload()

    def reload(self) -> bool:
        try:
            table = TokenTable.load(self._path)
        except (ConfigError, OSError) as exc:
            self.failures += 1
            log.error("tokens_file not reloaded, still serving the previous %d tenant(s): %s",
                      len(self._interceptor.tokens.tenants), exc)
            return False
        before = self._interceptor.tokens.tenants
        self._interceptor.tokens = table
        self.reloads += 1
        after = table.tenants
        log.info("tokens_file reloaded: %d tenant(s)%s%s", len(after),
                 f", added {sorted(after - before)}" if after - before else "",
                 f", removed {sorted(before - after)}" if before - after else "")
        for hook in self.on_reload:
            hook()
        return True
