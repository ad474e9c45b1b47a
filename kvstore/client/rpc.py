"""The client's gRPC seam: one channel, one stub, and the one place where grpc errors become kvstore errors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import KVStoreError, StoreUnavailableError, error_for_reason

__all__ = ["Rpc", "translate"]

T = TypeVar("T")
_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def translate(exc: grpc.RpcError, address: str) -> KVStoreError:
    """Map an RpcError to the exception class the daemon raised (by the kvstore-reason trailer)."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code in _UNAVAILABLE:
        return StoreUnavailableError(
            f"kvstore daemon at {address} unavailable ({code.name if code else '?'}: {details}); "
            "is kvstore-server running? (start it with `kvstore-server`, or set KVSTORE_ADDRESS)"
        )
    reason = "internal"
    trailers = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == "kvstore-reason":
            reason = value
    return error_for_reason(reason)(details or f"{code}")


def _target(address: str) -> str:
    if address.startswith("unix:") or address.startswith("unix-abstract:"):
        return address
    if address.startswith("/"):
        return "unix:" + address
    return address


class Rpc:
    """Owns the channel. `call(name, request)` returns the response or raises a KVStoreError."""

    def __init__(self, address: str, timeout_s: float, max_message_bytes: int = 64 << 20) -> None:
        self.address = address
        self.timeout_s = timeout_s
        opts = [("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes)]
        self.channel = grpc.insecure_channel(_target(address), options=opts)
        self.stub = pb_grpc.KVStoreStub(self.channel)

    def call(self, name: str, request: Any, timeout_s: float | None = None) -> Any:
        try:
            return getattr(self.stub, name)(request, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as exc:
            raise translate(exc, self.address) from None

    def stream(self, name: str, request: Any, consume: Callable[[Any], T]) -> T:
        """Run a streaming RPC and hand its result (a response or a response iterator) to `consume`."""
        try:
            return consume(getattr(self.stub, name)(request, timeout=self.timeout_s))
        except grpc.RpcError as exc:
            raise translate(exc, self.address) from None

    def close(self) -> None:
        self.channel.close()
