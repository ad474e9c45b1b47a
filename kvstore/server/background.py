"""The daemon's background threads: the sweeper (expiries, the tokens file) and the RAM journal's writer.

Started with the daemon, stopped before a hand-over's freeze (and started again if it fails) or a shutdown.
"""

from __future__ import annotations

import logging
import threading

from kvstore.arena.backing import ArenaBacking
from kvstore.engine.engine import Engine
from kvstore.server.token_reload import TokenWatcher

__all__ = ["Background"]

log = logging.getLogger("kvstore.server")


class Background:
    def __init__(self, engine: Engine, arena: ArenaBacking, sweep_s: float, journal_s: float, *,
                 hash_missing: bool, token_watcher: TokenWatcher | None) -> None:
        """`hash_missing`: the journal's writer hashes blocks committed without an xxh3 (under systemd's fd
        store: a crash then keeps every block it can check)."""
        self._engine, self._arena = engine, arena
        self._sweep_s, self._journal_s = sweep_s, journal_s
        self._hash_missing = hash_missing
        self._tokens = token_watcher
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._sweep_loop, name="kvstore-sweeper", daemon=True),
                         threading.Thread(target=self._journal_loop, name="kvstore-journal", daemon=True)]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=5)

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self._sweep_s):
            try:
                self._engine.sweep()
                if self._tokens is not None:
                    self._tokens.poll()
            except Exception:  # the sweeper must outlive a bug in one pass; the log says what happened
                log.exception("sweep failed")

    def _journal_loop(self) -> None:
        """Keep the RAM journal a second behind the catalog (a hand-over writes the rest itself)."""
        while not self._stop.wait(self._journal_s):
            try:
                self._engine.sync_journal(self._arena.view, hash_missing=self._hash_missing)
            except Exception:  # like the sweeper: one failed pass must not end the thread
                log.exception("journal sync failed")
