"""One etcd watch on a key prefix over the JSON gateway: the changes under it, as they happen.

    w = PrefixWatch.open(client, prefix, start_revision)   # POST /v3/watch; returns once etcd says "created"
    for batch in w.batches():                              # blocks until etcd sends something
        for ev in batch: ...                               # WatchEvent(put or delete, key, value, revision)
    w.close()                                              # from any thread: batches() then ends

The gateway answers a watch with one long HTTP response whose body is a stream of JSON objects, one a line:
first {"result": {"created": true, ...}}, then one {"result": {"events": [...]}} per revision that changed
something under the prefix (a put has no "type"; a delete has "type": "DELETE"). A watch etcd cancels (its
start revision was compacted away, or a permission was taken back) ends with WatchCanceled: the caller reads
the whole prefix again and watches from that answer's revision. Any other end (etcd stopped, the connection
reset, a line we cannot read) ends batches() with EtcdUnavailable.

Why a read timeout: a connection that dies without a reset (a host that vanished) would otherwise block the
watcher forever; `idle_s` without a byte ends the stream, and the caller reads and watches again (one range
request per idle period per node: still far below a poll's rate).
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from kvstore.peer.etcd import EtcdClient, EtcdUnavailable

__all__ = ["PrefixWatch", "WatchEvent", "WatchCanceled", "WatchIdle"]

MAX_LINE_BYTES = 4 << 20  # one answer line; member records are a few hundred bytes each


class WatchCanceled(EtcdUnavailable):
    """etcd ended the watch itself (compacted start revision, lost permission): read again, then watch again."""


class WatchIdle(WatchCanceled):
    """Nothing arrived for idle_s: normal on a quiet prefix; read again, then watch again (not an error)."""


@dataclass(frozen=True)
class WatchEvent:
    kind: str        # "put" | "delete"
    key: bytes
    value: bytes     # b"" for a delete
    revision: int    # the revision of this change (mod_revision)


class PrefixWatch:
    def __init__(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, idle_s: float) -> None:
        self._conn = conn
        self._resp = resp
        self._idle = idle_s
        self._closed = False
        self._reading = False           # a thread is inside batches(): it closes the connection when it ends
        self._lock = threading.Lock()

    @classmethod
    def open(cls, client: EtcdClient, prefix: bytes, start_revision: int, idle_s: float = 60.0,
             end: bytes | None = None) -> PrefixWatch:
        """Watch every key under `prefix` (or in [prefix, end)) from `start_revision`."""
        body = {"create_request": {"key": base64.b64encode(prefix).decode(),
                                   "range_end": base64.b64encode(end or EtcdClient.prefix_end(prefix)).decode(),
                                   "start_revision": str(max(1, start_revision))}}
        conn, resp = client.open_stream("/v3/watch", body)
        watch = cls(conn, resp, idle_s)
        try:
            first = watch._next_result()
            if first.get("canceled"):
                raise WatchCanceled(f"etcd canceled the watch at once: {first.get('cancel_reason') or first}")
            if not first.get("created"):
                raise EtcdUnavailable(f"etcd watch answered {first!r} instead of created")
            if conn.sock is not None:
                conn.sock.settimeout(idle_s)  # from here on a quiet prefix is normal: wait up to idle_s a line
        except BaseException:
            watch.close()
            raise
        return watch

    def _next_result(self) -> dict:
        try:
            line = self._resp.readline(MAX_LINE_BYTES + 1)
        except TimeoutError as exc:
            raise WatchIdle(f"no change for {self._idle:g}s") from exc
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise EtcdUnavailable(f"etcd watch stream ended: {exc}") from exc
        if not line:
            raise EtcdUnavailable("etcd watch stream ended (etcd closed it)")
        if len(line) > MAX_LINE_BYTES:
            raise EtcdUnavailable(f"etcd watch sent a line over {MAX_LINE_BYTES} bytes")
        try:
            answer = json.loads(line)
        except ValueError as exc:
            raise EtcdUnavailable(f"etcd watch sent a line that is not JSON: {line[:200]!r}") from exc
        if not isinstance(answer, dict):
            raise EtcdUnavailable(f"etcd watch sent {answer!r}")
        if "error" in answer:
            raise EtcdUnavailable(f"etcd watch failed: {answer['error']}")
        result = answer.get("result")
        if not isinstance(result, dict):
            raise EtcdUnavailable(f"etcd watch sent {answer!r} without a result")
        return result

    def batches(self) -> Iterator[list[WatchEvent]]:
        """The changes under the prefix, one list per revision etcd reports, until the stream ends (raises
        WatchCanceled or EtcdUnavailable; after close() it just stops)."""
        with self._lock:
            self._reading = True
        try:
            while not self._closed:
                try:
                    result = self._next_result()
                except EtcdUnavailable:
                    if self._closed:
                        return
                    raise
                if result.get("canceled"):
                    raise WatchCanceled(f"etcd canceled the watch: {result.get('cancel_reason') or ''} "
                                        f"(compact_revision {result.get('compact_revision', 0)})")
                events = result.get("events") or []
                if events:
                    yield [_event(e) for e in events]
        finally:
            with self._lock:
                self._reading = False
            self._conn.close()

    def close(self) -> None:
        """End the stream; safe from any thread and more than once. A reader blocked in batches() wakes up (the
        socket is shut down under it), returns and closes the connection itself: closing it here, under the
        reader, would pull the buffer out of its readline."""
        with self._lock:
            self._closed = True
            reading = self._reading
            sock = self._conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if not reading:
            self._conn.close()


def _event(e: object) -> WatchEvent:
    if not isinstance(e, dict) or not isinstance(e.get("kv"), dict):
        raise EtcdUnavailable(f"etcd watch sent an event without a key: {e!r}")
    kv = e["kv"]
    try:
        key = base64.b64decode(kv["key"])
        value = base64.b64decode(kv.get("value", ""))
        revision = int(kv.get("mod_revision", 0))
    except (KeyError, ValueError, TypeError) as exc:
        raise EtcdUnavailable(f"etcd watch sent an unreadable event {e!r}") from exc
    kind = "delete" if e.get("type") == "DELETE" else "put"
    return WatchEvent(kind, key, value if kind == "put" else b"", revision)
