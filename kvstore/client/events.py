"""An open Subscribe stream: KV events as an iterator that any thread can close (Client.subscribe returns one)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.rpc import Rpc, translate
from kvstore.client.types import KVEvent

__all__ = ["EventStream"]


class EventStream:
    """An open Subscribe stream: an iterator of KVEvent that can be closed from any thread."""

    def __init__(self, call: Any, address: str) -> None:
        self._call = call
        self._address = address

    def __iter__(self) -> Iterator[KVEvent]:
        try:
            for m in self._call:
                yield KVEvent.from_pb(m)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:
                return
            raise translate(exc, self._address) from None

    def close(self) -> None:
        self._call.cancel()

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @staticmethod
    def open(rpc: Rpc, namespaces: Sequence[str], buffer: int) -> EventStream:
        """Start a Subscribe call (Client.subscribe)."""
        request = pb.SubscribeRequest(namespaces=list(namespaces), buffer=buffer)
        return EventStream(rpc.stub.Subscribe(request, metadata=rpc.metadata), rpc.address)
