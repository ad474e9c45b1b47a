"""Key records for inspection: Describe and Explain in batches, ListKeys page by page (Client.describe,
Client.explain, Client.keys)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.batches import chunks
from kvstore.client.rpc import Rpc
from kvstore.client.types import KeyExplanation, KeyInfo

__all__ = ["describe", "explain", "keys"]


def describe(rpc: Rpc, namespace: str, keys: Sequence[bytes], batch: int) -> list[KeyInfo | None]:
    """Per key: its record, or None when absent (batches of at most `batch` keys, the daemon's max)."""
    out: list[KeyInfo | None] = []
    for part in chunks(len(keys), batch):
        r = rpc.call("Describe", pb.KeysRequest(namespace=namespace, keys=keys[part]))
        found = {k.key: KeyInfo.from_pb(k) for k in r.keys}
        out.extend(found.get(k) for k in keys[part])
    return out


def explain(rpc: Rpc, namespace: str, keys: Sequence[bytes], batch: int) -> list[KeyExplanation]:
    """Per key, in order: where it lives now, or why it is absent (batches of at most `batch` keys)."""
    out: list[KeyExplanation] = []
    for part in chunks(len(keys), batch):
        r = rpc.call("Explain", pb.KeysRequest(namespace=namespace, keys=keys[part]))
        out.extend(KeyExplanation.from_pb(e) for e in r.keys)
    return out


def keys(rpc: Rpc, namespace: str, start_after: bytes, limit: int | None, page_size: int) -> Iterator[KeyInfo]:
    """Records in byte order after `start_after` (exclusive), at most `limit`, fetched `page_size` at a time."""
    cursor, seen = start_after, 0
    while True:
        want = page_size if limit is None else min(page_size, limit - seen)
        if want <= 0:
            return
        r = rpc.call("ListKeys", pb.ListKeysRequest(namespace=namespace, cursor=cursor, limit=want))
        for k in r.keys:
            yield KeyInfo.from_pb(k)
        seen += len(r.keys)
        if not r.next_cursor:
            return
        cursor = r.next_cursor
