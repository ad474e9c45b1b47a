"""Bearer-token authentication: a gRPC server interceptor in front of every RPC when `tokens_file` is set.

Each call must carry the metadata `authorization: Bearer <token>`; the token's tenant (tokens file) is put in
`current_tenant` for the servicer (tenancy.py), set in the very thread that runs the handler. A missing or
unknown token is UNAUTHENTICATED with the trailer `kvstore-reason: unauthenticated` and a message that says
which, never echoing the token. Health is not exempt: an unauthenticated caller learns nothing, not even the
arena's name. Without a tokens file no interceptor is installed and every call runs as before.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from kvstore.security.tokens import TokenTable

__all__ = ["AuthInterceptor", "current_tenant"]

log = logging.getLogger(__name__)

# None: authentication is off (no tokens file); else the calling tenant. Set per call by the interceptor.
current_tenant: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvstore_tenant", default=None)


def _deny(context: grpc.ServicerContext, why: str) -> None:
    context.set_trailing_metadata((("kvstore-reason", "unauthenticated"),))
    context.abort(grpc.StatusCode.UNAUTHENTICATED, why)


class AuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, tokens: TokenTable) -> None:
        self.tokens = tokens        # replaced whole by token_reload.py; each call reads it once
        self._denied = 0            # refused calls since the last log line (a flood logs once per 10 s)
        self._next_log = 0.0
        self._log_lock = threading.Lock()

    def _log_denied(self, method: str, why: str) -> None:
        with self._log_lock:
            self._denied += 1
            now = time.monotonic()
            if now < self._next_log:
                return
            n, self._denied, self._next_log = self._denied, 0, now + 10.0
        log.warning("refused %d unauthenticated call(s), latest to %s: %s", n, method, why)

    def _tenant(self, metadata: Any) -> tuple[str | None, str]:
        values = [v for k, v in (metadata or ()) if k == "authorization"]
        if not values:
            return None, "missing bearer token: send `authorization: Bearer <token>` (Client(token_file=...), " \
                         "KVSTORE_TOKEN_FILE or kvstore --token-file)"
        scheme, _, token = str(values[0]).partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None, "malformed authorization metadata: expected `Bearer <token>`"
        tenant = self.tokens.tenant_of(token.strip())
        if tenant is None:
            return None, "invalid bearer token (not in the daemon's tokens_file)"
        return tenant, ""

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = continuation(details)
        if handler is None:
            return handler
        tenant, why = self._tenant(details.invocation_metadata)
        if tenant is None:
            self._log_denied(details.method, why)
        return _wrap(handler, tenant, why)


def _wrap(h: grpc.RpcMethodHandler, tenant: str | None, why: str) -> grpc.RpcMethodHandler:
    kw = dict(request_deserializer=h.request_deserializer, response_serializer=h.response_serializer)
    if h.unary_unary is not None:
        inner = h.unary_unary

        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            if tenant is None:
                return _deny(context, why)
            current_tenant.set(tenant)
            return inner(request, context)
        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    if h.unary_stream is not None:
        inner_us = h.unary_stream

        def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            if tenant is None:
                _deny(context, why)
                return
            current_tenant.set(tenant)
            yield from inner_us(request, context)
        return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
    if h.stream_unary is not None:
        inner_su = h.stream_unary

        def stream_unary(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            if tenant is None:
                return _deny(context, why)
            current_tenant.set(tenant)
            return inner_su(requests, context)
        return grpc.stream_unary_rpc_method_handler(stream_unary, **kw)
    inner_ss = h.stream_stream

    def stream_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        if tenant is None:
            _deny(context, why)
            return
        current_tenant.set(tenant)
        yield from inner_ss(requests, context)
    return grpc.stream_stream_rpc_method_handler(stream_stream, **kw)
