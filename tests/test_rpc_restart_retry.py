"""The client's retry across a hand-over's gRPC stop (kvstore/client/rpc.py): after a call met the closed gate
(`restarting`), a call the old daemon's server cancels as it stops is sent again and answered by the successor;
a CANCELLED with no hand-over seen is sent again only for a call that changes nothing (a Commit stays an error).
Real gRPC servers on a unix socket path, the successor taking the path over by rename as kvstore-server does."""

from __future__ import annotations

import os
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client.rpc import Rpc
from kvstore.errors import StoreUnavailableError

pytestmark = pytest.mark.timeout(60)


class Daemon(pb_grpc.KVStoreServicer):
    """Health answers `status` (the successor), or refuses as a closed gate (`refuse` calls), or holds the call
    until `released` and then ends it CANCELLED (`reset`: what a stream reset as the old process exits gives)
    or holds it until its server stops (which ends it UNAVAILABLE, "Cancelling all calls")."""

    def __init__(self, status: str, refuse: int = 0, hold: bool = False, reset: bool = False) -> None:
        self.status, self.refuse, self.hold, self.reset = status, refuse, hold, reset
        self.calls = 0
        self.entered = threading.Event()
        self.released = threading.Event()

    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitResponse:  # noqa: N802
        """A call that changes the daemon, held and cut off as Health is."""
        self.Health(pb.HealthRequest(), context)
        return pb.CommitResponse(committed=1)

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:  # noqa: N802
        self.calls += 1
        if self.refuse:
            self.refuse -= 1
            context.set_trailing_metadata((("kvstore-reason", "restarting"),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "handing over")
        if self.hold:
            self.entered.set()
            while context.is_active() and not self.released.is_set():
                threading.Event().wait(0.01)
            if self.reset:
                self.reset = False
                context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
            while context.is_active():
                threading.Event().wait(0.01)
            return pb.HealthResponse()
        return pb.HealthResponse(status=self.status)


def _serve(servicer: Daemon, sock: Path, name: str) -> grpc.Server:
    """Bound under a temporary name, then renamed over `sock`, as kvstore-server does (so the stop of a server
    unlinks its own temporary name, not the path a successor took over)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_KVStoreServicer_to_server(servicer, server)
    tmp = f"{sock}.{name}"
    server.add_insecure_port(f"unix:{tmp}")
    server.start()
    os.rename(tmp, sock)
    return server


def _hand_over(old: grpc.Server, old_daemon: Daemon, sock: Path) -> tuple[grpc.Server, Daemon]:
    """Once the old daemon holds a call: the successor takes the path over, the held call is let go (a reset
    one ends CANCELLED now) and the old server stops at once (its grace spent), cutting off what it still holds."""
    assert old_daemon.entered.wait(10)
    new = Daemon("SUCCESSOR")
    server = _serve(new, sock, "new")
    old_daemon.released.set()
    old.stop(0).wait(5)
    return server, new


@pytest.mark.parametrize("cut", ["stop", "reset"])
def test_a_call_cut_off_by_the_old_daemon_is_answered_by_the_successor(tmp_path: Path, cut: str) -> None:
    sock = tmp_path / "kvstore.sock"
    old_daemon = Daemon("OLD", refuse=1, hold=True, reset=cut == "reset")
    old = _serve(old_daemon, sock, "old")
    rpc = Rpc(f"unix:{sock}", timeout_s=10.0)
    try:                                              # the retry after the refusal lands on the old server
        out: list = []
        t = threading.Thread(target=lambda: out.append(rpc.call("Health", pb.HealthRequest())))
        t.start()
        new, new_daemon = _hand_over(old, old_daemon, sock)
        t.join(20)
        assert [r.status for r in out] == ["SUCCESSOR"]
        # refused, then cut off (a reset call's retry may meet the old server once more before it stops)
        assert old_daemon.calls == 2 if cut == "stop" else old_daemon.calls in (2, 3)
        assert new_daemon.calls == 1
        new.stop(0)
    finally:
        rpc.channel.close()


def test_a_cancelled_call_with_no_hand_over_seen_is_an_error(tmp_path: Path) -> None:
    sock = tmp_path / "kvstore.sock"
    old_daemon = Daemon("OLD", hold=True)
    old = _serve(old_daemon, sock, "old")
    rpc = Rpc(f"unix:{sock}", timeout_s=10.0)
    try:
        errors: list[BaseException] = []

        def call() -> None:
            try:
                rpc.call("Health", pb.HealthRequest())
            except StoreUnavailableError as exc:
                errors.append(exc)
        t = threading.Thread(target=call)
        t.start()
        new, new_daemon = _hand_over(old, old_daemon, sock)
        t.join(20)
        assert len(errors) == 1 and "Cancelling all calls" in str(errors[0])
        assert (old_daemon.calls, new_daemon.calls) == (1, 0)   # not sent again: it may have run
        new.stop(0)
    finally:
        rpc.channel.close()


@pytest.mark.parametrize("method,request_", [("Health", pb.HealthRequest()), ("Commit", pb.CommitRequest())])
def test_a_reset_call_with_no_hand_over_seen_is_sent_again_only_when_it_changes_nothing(
        tmp_path: Path, method: str, request_: object) -> None:
    """CANCELLED by the old server (its stream reset as it exits) before this client met a `restarting` refusal
    (its previous call came before the gate closed): a read-only call goes to the successor, a Commit (it may
    have run) is an error, not sent again."""
    sock = tmp_path / "kvstore.sock"
    old_daemon = Daemon("OLD", hold=True, reset=True)
    old = _serve(old_daemon, sock, "old")
    rpc = Rpc(f"unix:{sock}", timeout_s=10.0)
    try:
        out: list = []

        def call() -> None:
            try:
                out.append(rpc.call(method, request_))
            except StoreUnavailableError as exc:
                out.append(exc)
        t = threading.Thread(target=call)
        t.start()
        assert old_daemon.entered.wait(10)
        new_daemon = Daemon("SUCCESSOR")
        new = _serve(new_daemon, sock, "new")
        old_daemon.refuse = 1000            # its gate closes: every later call refused unrun
        old_daemon.released.set()           # the held call ends CANCELLED ...
        time.sleep(0.3)
        old.stop(0).wait(5)                 # ... before the old server stops
        t.join(20)
        if method == "Health":
            assert [r.status for r in out] == ["SUCCESSOR"] and new_daemon.calls == 1
        else:
            assert len(out) == 1 and isinstance(out[0], StoreUnavailableError) and "CANCELLED" in str(out[0])
            assert (old_daemon.calls, new_daemon.calls) == (1, 0)
        new.stop(0)
    finally:
        rpc.channel.close()
