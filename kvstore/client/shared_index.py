"""The client's handle on its tenant's shared key index (kvstore/fastpath/key_index.py).

Fetched over the same-node socket on first use (one HELLO asking for it; the token decides which tenant's
table), and fetched again once a reply shows that the daemon restarted (its incarnation moved on): the old
table is frozen and belongs to a process that is gone. A failed fetch (the daemon runs without an index, or
is restarting) is retried after RETRY_S; until then probes go to the daemon the usual way. Nothing here is
needed for correctness: the daemon checks every entry a probe names (Engine.probe).

$KVSTORE_KEY_INDEX=0 keeps a client from using the index (to compare, or to rule it out).
"""

from __future__ import annotations

import logging
import os
import time

from kvstore.client.fast_channel import request_key_index
from kvstore.errors import ConfigError, KVStoreError
from kvstore.fastpath.key_index import IndexView

__all__ = ["SharedIndex", "index_wanted"]

log = logging.getLogger(__name__)

RETRY_S = 5.0


def index_wanted() -> bool:
    """$KVSTORE_KEY_INDEX: unset or 1 uses the shared key index where the daemon offers one, 0 never does."""
    raw = os.environ.get("KVSTORE_KEY_INDEX", "").strip()
    if raw not in ("", "0", "1"):
        raise ConfigError(f"KVSTORE_KEY_INDEX={raw!r}: use 1 (use the daemon's shared key index, the default) or 0")
    return raw != "0"


class SharedIndex:
    def __init__(self, path: str, token: str, timeout_s: float) -> None:
        self._path = path
        self._token = token
        self._timeout = timeout_s
        self._view: IndexView | None = None
        self._retry_at = 0.0
        self.why = "not fetched yet"  # why there is no view (logged once per reason)

    def view(self) -> IndexView | None:
        """The current table, fetching it when due; None when there is none to use now."""
        v = self._view
        if v is not None or time.monotonic() < self._retry_at:
            return v
        try:
            fd, _ = request_key_index(self._path, self._token, self._timeout)
            v = IndexView(fd)
        except (KVStoreError, ValueError, OSError) as exc:
            self._retry_at = time.monotonic() + RETRY_S
            if self.why != str(exc):
                log.info("kvstore client probing without the shared key index: %s", exc)
            self.why = str(exc)
            return None
        self._view, self.why = v, ""
        return v

    def seen(self, view: IndexView, incarnation: int) -> None:
        """A reply came from daemon `incarnation`: a table of another one is dropped (fetched again next time)."""
        if view.incarnation != incarnation and self._view is view:
            self._view = None
            self._retry_at = 0.0
            self.why = "the daemon restarted"
