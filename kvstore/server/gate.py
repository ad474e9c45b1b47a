"""The gRPC front door during a hand-over: calls in flight finish, new ones are told to retry at the successor.

Why not stop the gRPC server: grpc unlinks its unix socket's path when it stops, and by then that path is the
successor's (it binds a temporary path and renames it over ours: kvstore/server/main.py). So the old daemon
keeps its server, closes this gate at the freeze (every new call answers UNAVAILABLE with the trailer
`kvstore-reason: restarting`: the call was not run, and kvstore's client retries it, kvstore/client/rpc.py),
waits for the calls in flight (`drain`), and exits without stopping the server; the clients' channels then
reconnect to the path, which is the successor's. A hand-over that fails opens the gate again.

Streaming replies (Subscribe, Get streams) are checked at their start but not waited for: a subscriber's
stream ends when the old process exits, and it subscribes again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

__all__ = ["GateInterceptor", "RESTARTING"]

log = logging.getLogger(__name__)
RESTARTING = "restarting"  # the kvstore-reason of a call refused by a closed gate (never run: safe to retry)


class GateInterceptor(grpc.ServerInterceptor):
    def __init__(self) -> None:
        self._open = True
        self._cond = threading.Condition()
        self._in_flight = 0
        self._logged = False
        self.refused = 0

    def close(self) -> None:
        with self._cond:
            self._open = False
            self._logged = False

    def reopen(self) -> None:
        with self._cond:
            self._open = True

    def drain(self, timeout_s: float) -> int:
        """Wait until no counted call runs (at most timeout_s); the calls still running then."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._in_flight and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            return self._in_flight

    def _enter(self, context: grpc.ServicerContext) -> None:
        with self._cond:
            if self._open:
                self._in_flight += 1
                return
            self.refused += 1
            first, self._logged = not self._logged, True
        if first:
            log.info("gRPC calls refused as `restarting` during the hand-over's window (clients send them again)")
        context.set_trailing_metadata((("kvstore-reason", RESTARTING),))
        context.abort(grpc.StatusCode.UNAVAILABLE, "kvstore-server is handing over to its successor; retry")

    def _exit(self) -> None:
        with self._cond:
            self._in_flight -= 1
            if not self._in_flight:
                self._cond.notify_all()

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        h = continuation(details)
        if h is None:
            return h
        kw = dict(request_deserializer=h.request_deserializer, response_serializer=h.response_serializer)
        if h.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._counted(h.unary_unary), **kw)
        if h.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(self._counted(h.stream_unary), **kw)
        if h.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(self._checked(h.unary_stream), **kw)
        return grpc.stream_stream_rpc_method_handler(self._checked(h.stream_stream), **kw)

    def _counted(self, inner: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[[Any, grpc.ServicerContext], Any]:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            self._enter(context)
            try:
                return inner(request, context)
            finally:
                self._exit()
        return call

    def _checked(self, inner: Callable[[Any, grpc.ServicerContext], Iterator[Any]]
                 ) -> Callable[[Any, grpc.ServicerContext], Iterator[Any]]:
        def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            self._enter(context)
            self._exit()
            yield from inner(request, context)
        return call
