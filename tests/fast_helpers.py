"""Shared pieces of the same-node fast-path tests (key index gets, spare-slot puts): key sets, counter moves
around a call, and a writer that keeps reusing slots under a reader."""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.testing import DaemonProcess

__all__ = ["keyset", "moved", "churning", "counting", "no_index_client", "two_chains"]


def keyset(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def moved(c: Client, run: Callable[[], Any], counted: Sequence[str]) -> tuple[Any, dict[str, int]]:
    """run()'s result, and how far the daemon's `counted` counters and its fast-path request count moved."""
    before = c.stats()
    out = run()
    after = c.stats()
    delta = {k: after.counters.get(k, 0) - before.counters.get(k, 0) for k in counted}
    delta["fast_requests"] = after.control.fast_requests - before.control.fast_requests
    return out, delta


@contextlib.contextmanager
def churning(daemon: DaemonProcess, ns: str, keys: Sequence[bytes], value: Callable[[bytes], bytes]) -> Iterator[None]:
    """While inside: a writer deletes every other key and stores it again, over and over, so their slots go to
    other keys (`value(key)`: the bytes each key is stored with)."""
    stop = threading.Event()

    def churn() -> None:
        with Client(daemon.address, control="fast") as w:
            while not stop.is_set():
                for k in keys[::2]:
                    w.delete(ns, [k])
                for k in reversed(keys[::2]):
                    w.put(ns, k, value(k))
    writer = threading.Thread(target=churn)
    writer.start()
    try:
        yield
    finally:
        stop.set()
        writer.join(10)


def counting(obj: Any, name: str) -> list[bool]:
    """Wrap obj.name (on the instance) to record, per call, whether it answered (not None)."""
    real, answered = getattr(obj, name), []

    def counted(*args: Any) -> Any:
        out = real(*args)
        answered.append(out is not None)
        return out
    setattr(obj, name, counted)
    return answered


def no_index_client(address: str, monkeypatch: pytest.MonkeyPatch, **kw: object) -> Client:
    """A fast-path client with the shared key index turned off: every probe asks the daemon (the reference)."""
    with monkeypatch.context() as m:
        m.setenv("KVSTORE_KEY_INDEX", "0")
        return Client(address, control="fast", **kw)  # type: ignore[arg-type]


def two_chains(daemon: DaemonProcess, names: tuple[str, str], keys: Sequence[bytes]) -> None:
    """keys[:280] stored in the first namespace, keys[:100] in the second (4 KiB blocks of 1s and 2s)."""
    with daemon.client() as writer:
        for ns in names:
            writer.register_namespace(ns)
        writer.put_many(names[0], keys[:280], [np.full(4096, 1, np.uint8)] * 280)
        writer.put_many(names[1], keys[:100], [np.full(4096, 2, np.uint8)] * 100)
