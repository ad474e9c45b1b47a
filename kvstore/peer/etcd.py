"""A minimal etcd v3 client over etcd's JSON gateway (HTTP POST /v3/...), with the standard library only.

Why not a gRPC etcd client: `etcd3` 0.12 breaks on protobuf >= 4 and this daemon pins protobuf 7 for its own
stubs; `aetcd` is asyncio-only and ships its own generated stubs, another protobuf coupling to keep in step.
Membership needs five calls (lease grant / keepalive / revoke, put, prefix range), each a tiny JSON POST that
every etcd >= 3.4 serves on its client port, so urllib is enough and nothing can drift against our protobuf.
Watches are not used: the member set is a few keys, re-read every `peer_refresh_s` (one small range request),
which also heals by itself after an etcd outage without tracking watch revisions.

Every failure (refused, timeout, HTTP error, unreadable answer) is raised as EtcdUnavailable; the caller keeps
serving and retries on its next tick.
"""

from __future__ import annotations

import base64
import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Sequence

__all__ = ["EtcdClient", "EtcdUnavailable"]


class EtcdUnavailable(Exception):
    """No endpoint answered the call (down, unreachable, or an answer we could not read)."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _prefix_end(prefix: bytes) -> bytes:
    """The range end that selects every key starting with `prefix` (etcd's convention: last byte + 1)."""
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    if not p:
        return b"\x00"
    p[-1] += 1
    return bytes(p)


class EtcdClient:
    def __init__(self, endpoints: Sequence[str], timeout_s: float = 1.0) -> None:
        if not endpoints:
            raise ValueError("EtcdClient needs at least one endpoint")
        self._endpoints = [e.rstrip("/") for e in endpoints]
        self._timeout = timeout_s
        self._preferred = 0  # the endpoint that answered last: tried first next time

    def _post(self, path: str, body: dict) -> dict:
        data = json.dumps(body).encode()
        last: Exception | None = None
        n = len(self._endpoints)
        for i in range(n):
            idx = (self._preferred + i) % n
            req = urllib.request.Request(self._endpoints[idx] + path, data=data,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self._timeout) as resp:
                    answer = json.loads(resp.read() or b"{}")
                self._preferred = idx
                return answer
            except (OSError, urllib.error.URLError, http.client.HTTPException, ValueError) as exc:
                last = exc
        raise EtcdUnavailable(f"etcd {', '.join(self._endpoints)}: {last}") from last

    def grant(self, ttl_s: int) -> int:
        """A new lease with this TTL (seconds, >= 1); its id."""
        answer = self._post("/v3/lease/grant", {"TTL": max(1, int(ttl_s))})
        try:
            return int(answer["ID"])
        except (KeyError, ValueError) as exc:
            raise EtcdUnavailable(f"etcd lease grant answered {answer!r}") from exc

    def keepalive(self, lease_id: int) -> int:
        """Renew a lease; its remaining TTL, 0 when it no longer exists (expired or revoked)."""
        answer = self._post("/v3/lease/keepalive", {"ID": str(lease_id)})
        return int(answer.get("result", {}).get("TTL", 0) or 0)

    def revoke(self, lease_id: int) -> None:
        self._post("/v3/lease/revoke", {"ID": str(lease_id)})

    def put(self, key: bytes, value: bytes, lease_id: int = 0) -> None:
        body: dict[str, object] = {"key": _b64(key), "value": _b64(value)}
        if lease_id:
            body["lease"] = str(lease_id)
        self._post("/v3/kv/put", body)

    def range_prefix(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """Every (key, value) under `prefix`."""
        answer = self._post("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))})
        try:
            return [(base64.b64decode(kv["key"]), base64.b64decode(kv.get("value", "")))
                    for kv in answer.get("kvs", [])]
        except (KeyError, ValueError, TypeError) as exc:
            raise EtcdUnavailable(f"etcd range answered {answer!r}") from exc
