"""A fail-soft handle on the kvstore daemon for code running inside vLLM.

Principle 7 of the design: a store that is down, slow or full costs vLLM its hits, never a request. So the
connector never lets a kvstore exception escape into vLLM's scheduler or model runner. `StoreLink` connects
lazily, and after a failure stays "down" for ``retry_s`` (no RPC, no timeout paid per request) before trying
again; every call returns None while down. Namespaces are registered on first use and again after a daemon
restart (the daemon forgets them; UnknownNamespaceError triggers one re-register + retry).

Restarts (a hand-over, systemd's restart, a kill -9 and a start; docs/operations.md). What the link does so that
every request from the moment the daemon serves again gets what it holds:
- an UNAVAILABLE call is not always a down store: after a restart the client reconnects on its own, and only
  what met the old connection failed. So the link asks for one empty round trip; if the daemon answers, the call
  is sent once more (its effects, if the old daemon applied any, died with it: a lease or reservation of a
  daemon that restarted is unknown to the new one) instead of being dropped, and the store is not paused;
- a save whose spare slots went with their connection (SlotsLostError) is a lost save, never a pause;
- while paused, each call checks (at most every PROBE_S) whether the daemon's socket accepts again, and
  connects at once when it does, instead of waiting out `retry_s` (which remains the pause when a connect fails:
  a socket that accepts but a daemon that does not answer yet).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvstore.client import Client
from kvstore.client.slot_bank import SlotsLostError
from kvstore.errors import KVStoreError, StoreUnavailableError, UnknownNamespaceError
from kvstore.paths import default_address

__all__ = ["StoreLink", "PROBE_S"]

log = logging.getLogger(__name__)
T = TypeVar("T")
PROBE_S = 0.05  # while paused, how often a call checks whether the daemon's socket accepts again


class StoreLink:
    def __init__(self, address: str | None, *, timeout_s: float, copy_threads: int = 2, retry_s: float = 5.0,
                 namespace_spec: Callable[[str], dict[str, Any]] | None = None,
                 client_factory: Callable[[], Client] | None = None,
                 on_unreachable: Callable[[], None] | None = None) -> None:
        """``address`` None: the one rule of the daemon, its client and the CLI ($KVSTORE_ADDRESS, else the
        daemon's default socket; kvstore/paths.py), resolved now so every message names what was dialled.
        ``on_unreachable``: called at every connect that fails (the connector counts them)."""
        self.address = address or default_address()
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        target = self.address
        self._factory = client_factory or (lambda: Client(target, timeout_s=timeout_s, copy_threads=copy_threads))
        self._on_unreachable = on_unreachable or (lambda: None)
        self._connected_once = False
        self._namespace_spec = namespace_spec or (lambda name: {})
        self._client: Client | None = None
        self._down_until = 0.0
        self._registered: set[str] = set()
        self._lock = threading.Lock()
        self._tenant: str | None = None
        self._next_probe = 0.0
        self.failures = 0
        self.retried = 0  # calls sent again after meeting a restarted daemon's old connection

    @property
    def client(self) -> Client | None:
        """The connected client, connecting if the retry pause is over or the daemon's socket accepts again;
        None while the store is down."""
        with self._lock:
            if self._client is not None:
                return self._client
            now = time.monotonic()
            if now < self._down_until and not self._back(now):
                return None
            try:
                self._client = self._factory()
                self._tenant = self._client.tenant
                log.info("kvstore connector connected to %s (%s mode%s)", self._client.address, self._client.mode,
                         f", tenant {self._tenant}" if self._tenant else "")
                self._connected_once = True
            except StoreUnavailableError as exc:
                self._on_unreachable()
                if not self._connected_once and self._down_until == 0.0:
                    self._warn_unreachable(exc)
                self._mark_down_locked(exc, quiet=not self._connected_once)
            except KVStoreError as exc:
                self._mark_down_locked(exc)
            return self._client

    def _warn_unreachable(self, exc: StoreUnavailableError) -> None:
        """Once per process, the first time the daemon cannot be reached: where it was looked for and how to
        point the connector at it. Later failed retries are counted (`on_unreachable`), not logged."""
        log.warning("KVStoreConnector: no kvstore-server answers at %s (%s). vLLM serves without the store (every "
                    "prompt is computed) and the connector retries every %.0fs. Fix: start kvstore-server on this "
                    "node with its defaults, or set KVSTORE_ADDRESS (or kv_connector_extra_config.address) to its "
                    "socket, e.g. KVSTORE_ADDRESS=unix:/run/kvstore/kvstore.sock", self.address,
                    _reason(exc), self.retry_s)

    def connect(self) -> bool:
        """Try to reach the daemon now (at startup, so an unreachable one is reported before the first
        request); True when connected."""
        return self.client is not None

    @property
    def tenant(self) -> str | None:
        """The tenant of this process's token as the daemon named it on the last connect ('' without tokens);
        None before the first one. Namespace names carry it (kvstore_connector/namespace.py): their builders ask
        `client` first (the scheduler's lookup, the worker's saves and loads), so a name is built once the
        tenant is known. Reading it never connects: when it did (from inside a save's steps), the link of
        tests/test_arena_remap.py's kill -9 stress no longer came back after the last restart (why, not
        traced further)."""
        return self._tenant

    def _back(self, now: float) -> bool:
        """Under the lock, while paused: whether the daemon's socket accepts a connection now (a restarted
        daemon serves again), checked at most every PROBE_S."""
        if now < self._next_probe:
            return False
        self._next_probe = now + PROBE_S
        return _accepts(self.address, min(self.timeout_s, 0.05))

    def _mark_down_locked(self, exc: BaseException, quiet: bool = False) -> None:
        self.failures += 1
        if not quiet and (self._down_until == 0.0 or self._client is not None):
            log.warning("kvstore unavailable (%s); serving without it, retrying every %.0fs", exc, self.retry_s)
        if self._client is not None:
            self._client.close()
            self._client = None
        self._registered.clear()
        self._down_until = time.monotonic() + self.retry_s

    def mark_down(self, exc: BaseException) -> None:
        with self._lock:
            self._mark_down_locked(exc)

    def call(self, namespace: str | Sequence[str], fn: Callable[[Client], T]) -> T | None:
        """Run ``fn(client)`` with ``namespace`` (or each of several) registered; None (and a log line) on any
        store error."""
        c = self.client
        if c is None:
            return None
        names = [namespace] if isinstance(namespace, str) else list(namespace)
        try:
            for name in names:
                self._ensure(c, name)
            try:
                return fn(c)
            except UnknownNamespaceError:
                self._registered.difference_update(names)  # daemon restarted: it forgot its namespaces
                for name in names:
                    self._ensure(c, name)
                return fn(c)
        except SlotsLostError as exc:  # a lost save, not a down store
            self.failures += 1
            log.info("kvstore save lost with its connection: %s", exc)
            return None
        except KVStoreError as exc:
            if exc.grpc_code != "UNAVAILABLE":
                self.failures += 1
                log.warning("kvstore call failed: %s", exc)
                return None
            if not _answers(c):
                self.mark_down(exc)
                return None
            return self._again(c, names, fn, exc)
        except Exception:  # noqa: BLE001 - nothing from the store may escape into vLLM's scheduler or worker
            self.failures += 1
            log.exception("kvstore call failed unexpectedly")
            return None

    def _again(self, c: Client, names: list[str], fn: Callable[[Client], T], first: KVStoreError) -> T | None:
        """The call met the old connection of a daemon that answers now: once more (namespaces registered again:
        a daemon that restarted cold forgot them)."""
        self.retried += 1
        self._registered.difference_update(names)
        try:
            for name in names:
                self._ensure(c, name)
            return fn(c)
        except KVStoreError as exc:
            self.failures += 1
            log.warning("kvstore call failed (%s), and again after the daemon answered: %s", first, exc)
            return None

    def _ensure(self, c: Client, namespace: str) -> None:
        if namespace not in self._registered:
            c.register_namespace(namespace, **self._namespace_spec(namespace))
            self._registered.add(namespace)

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def _reason(exc: StoreUnavailableError) -> str:
    """The transport's reason without the client's own advice (the warning gives the connector's)."""
    text = str(exc)
    start = text.find(" unavailable (")
    return text[start + len(" unavailable ("):text.rfind("); is kvstore-server")] if start >= 0 else text


def _accepts(address: str, timeout_s: float) -> bool:
    """Whether the daemon's socket accepts a connection (no request sent): a unix socket path, or host:port."""
    path = address[len("unix:"):] if address.startswith("unix:") else address
    try:
        if path.startswith("/"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout_s)
                s.connect(path)
            return True
        host, _, port = path.rpartition(":")
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _answers(c: Client) -> bool:
    """Whether the daemon answers an empty round trip now (the client reconnects to a restarted one itself)."""
    try:
        c.echo()
        return True
    except Exception:  # noqa: BLE001 - any failure here means: treat the store as down
        return False
