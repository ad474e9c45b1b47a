"""The client's gRPC seam: one channel, one stub, and the one place where grpc errors become kvstore errors.

Security lives here too: a TCP address with TLS material (`tls=`, or KVSTORE_TLS_CA / KVSTORE_TLS_CERT /
KVSTORE_TLS_KEY) gets a TLS channel (mutual TLS when a certificate is given); a unix socket is always plain
(owner-only). A token (read from `token_file` or KVSTORE_TOKEN_FILE, never passed as a value) rides on every
call as `authorization: Bearer <token>`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import os
import time

import grpc

from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import KVStoreError, StoreUnavailableError, error_for_reason
from kvstore.security.tls import TlsFiles
from kvstore.security.tokens import read_client_token

__all__ = ["Rpc", "translate", "tls_from_env", "open_channel"]

T = TypeVar("T")
_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
# after a `restarting` refusal, how long a call that ends UNAVAILABLE or CANCELLED is taken for one the
# handing-over daemon cut off as it stopped (kvstore/server/handover_host.py `commit`): sent again like a refused one
RESTART_CANCEL_S = 5.0
_CUT_OFF = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
# calls that change nothing in the daemon: one cut off as the old daemon stops is sent again even when this client
# met no `restarting` refusal first (its previous call came before the gate closed; CI met a CANCELLED Exists
# there), since running twice is running once
READ_ONLY = frozenset({"Health", "Exists", "Stats", "ListKeys", "Describe", "Explain", "ExplainSession",
                       "ListSessions", "PrefixScore"})


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


def _restarting(exc: grpc.RpcError) -> bool:
    """Whether the daemon refused the call unrun because it is handing over (kvstore/server/gate.py)."""
    code = exc.code() if hasattr(exc, "code") else None
    if code != grpc.StatusCode.UNAVAILABLE:
        return False
    trailers = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    return any(k == "kvstore-reason" and v == "restarting" for k, v in trailers or ())


def _target(address: str) -> str:
    if address.startswith("unix:") or address.startswith("unix-abstract:"):
        return address
    if address.startswith("/"):
        return "unix:" + address
    return address


def tls_from_env() -> TlsFiles:
    env = os.environ
    return TlsFiles(env.get("KVSTORE_TLS_CERT", ""), env.get("KVSTORE_TLS_KEY", ""), env.get("KVSTORE_TLS_CA", ""))


def open_channel(address: str, tls: TlsFiles | None, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
    """TLS channel for a TCP address when TLS material is given, else a plain one (always for unix sockets)."""
    target = _target(address)
    if tls is not None and tls.enabled and not target.startswith(("unix:", "unix-abstract:")):
        tls.check("client", need_identity=False, need_ca=False)
        return grpc.secure_channel(target, tls.grpc_channel_credentials(), options=options)
    return grpc.insecure_channel(target, options=options)


class Rpc:
    """Owns the channel. `call(name, request)` returns the response or raises a KVStoreError."""

    def __init__(self, address: str, timeout_s: float, max_message_bytes: int = 64 << 20, *,
                 tls: TlsFiles | None = None, token_file: str | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        opts = [("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                # a daemon that restarts (a hand-over, systemd) is back within a second: dial again after
                # 50 ms, not grpc's default of a second or more, so the first calls after it serves get it
                ("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                ("grpc.max_reconnect_backoff_ms", 2000)]
        token_file = token_file if token_file is not None else os.environ.get("KVSTORE_TOKEN_FILE", "")
        token = read_client_token(token_file) if token_file else ""
        self.token = token  # also presented to the arena socket (kvstore/server/fast_server.py)
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", "Bearer " + token),) if token else ()
        self.channel = open_channel(address, tls if tls is not None else tls_from_env(), opts)
        self.stub = pb_grpc.KVStoreStub(self.channel)
        self._restart_seen = float("-inf")  # when a call last met a daemon handing over (its `restarting`)

    def call(self, name: str, request: Any, timeout_s: float | None = None) -> Any:
        """The response, or the daemon's error as a KVStoreError. A call the daemon refused because it is handing
        over to a successor (reason `restarting`: it did not run) is sent again, backing off from 20 ms to 200 ms,
        until the successor answers or the call's time is spent (a hand-over's window is well under a second).

        So is a call that ends UNAVAILABLE or CANCELLED within RESTART_CANCEL_S of a `restarting` refusal: the
        old daemon closed its gate (refusing every new call unrun) and drained the calls it had admitted before
        its commit stops its gRPC server and it exits, which cuts off what is still on its connections ("Cancelling
        all calls", or a reset stream): calls the gate was refusing, or one it admitted that ran past the
        freeze's drain (5 s), which is sent again too (a call that ran twice answers as a repeated one does: a
        Commit of a committed reservation is an error, never other bytes). With no hand-over seen, both stay
        errors for calls that change the daemon (a CI run met a CANCELLED there: tests/test_handover.py's gRPC
        client); a READ_ONLY call that ends CANCELLED (the server cut it: this client never cancels a unary call)
        is sent again all the same, since a client whose previous call came before the gate closed meets the stop
        first (CI again: a CANCELLED Exists); a daemon that is simply gone then answers UNAVAILABLE, an error."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        pause = 0.02
        last: grpc.RpcError | None = None
        while True:
            try:
                return getattr(self.stub, name)(request, timeout=max(0.05, deadline - time.monotonic()),
                                                metadata=self.metadata)
            except ValueError:   # the channel was closed under a call being sent again: its first error stands
                if last is None:
                    raise
                raise translate(last, self.address) from None
            except grpc.RpcError as exc:
                last = exc
                now = time.monotonic()
                if _restarting(exc):
                    self._restart_seen = now
                code = exc.code() if hasattr(exc, "code") else None
                cut_off = (code in _CUT_OFF and now - self._restart_seen < RESTART_CANCEL_S) or (
                    code == grpc.StatusCode.CANCELLED and name in READ_ONLY)
                if (_restarting(exc) or cut_off) and now + pause < deadline:
                    time.sleep(pause)
                    pause = min(0.2, pause * 2)
                    continue
                raise translate(exc, self.address) from None

    def stream(self, name: str, request: Any, consume: Callable[[Any], T]) -> T:
        """Run a streaming RPC and hand its result (a response or a response iterator) to `consume`."""
        try:
            return consume(getattr(self.stub, name)(request, timeout=self.timeout_s, metadata=self.metadata))
        except grpc.RpcError as exc:
            raise translate(exc, self.address) from None

    def close(self) -> None:
        self.channel.close()
