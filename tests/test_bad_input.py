"""Every bad request gets its own status code, reason and message, and the daemon keeps serving.

Uses a bare gRPC stub so the exact status code and trailing reason are checked, not the client's mapping;
one test then checks that the client raises the matching exception class.
"""

from __future__ import annotations

import grpc
import pytest

from kvstore import (
    BatchTooLargeError,
    Client,
    ConflictError,
    InvalidRequestError,
    ReservationClosedError,
    UnknownNamespaceError,
    UnknownReservationError,
)
from kvstore._proto import kvstore_pb2 as pb
from tests.control_paths import per_path_daemon
from kvstore.testing import DaemonProcess, raw_stub, wait_until

pytestmark = pytest.mark.usefixtures("control_path")  # every test over the fast path and over gRPC
daemon = per_path_daemon()

NS = "bad/ns"
TOK = "bad/tokens"  # registered with tokens_per_block=16
C = grpc.StatusCode


@pytest.fixture(scope="module")
def stub(daemon: DaemonProcess):
    ch, st = raw_stub(daemon.address)
    st.RegisterNamespace(pb.RegisterNamespaceRequest(name=NS, model="m"))
    st.RegisterNamespace(pb.RegisterNamespaceRequest(name=TOK, tokens_per_block=16))
    yield st
    ch.close()


def _status(call, request) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=10)
    err = info.value
    reason = dict(err.trailing_metadata() or ()).get("kvstore-reason", "")
    return err.code(), reason, err.details()


CASES = [
    ("empty key", "Reserve", pb.ReserveRequest(namespace=NS, keys=[b""], sizes=[1]),
     C.INVALID_ARGUMENT, "invalid_request", "key 0 has 0 bytes"),
    ("65-byte key", "Lookup", pb.LookupRequest(namespace=NS, keys=[b"x" * 65]),
     C.INVALID_ARGUMENT, "invalid_request", "keys must be 1..64 bytes"),
    ("no keys", "Exists", pb.KeysRequest(namespace=NS), C.INVALID_ARGUMENT, "invalid_request", "empty key batch"),
    ("size zero", "Reserve", pb.ReserveRequest(namespace=NS, keys=[b"a"], sizes=[0]),
     C.INVALID_ARGUMENT, "invalid_request", "size 0 of key 0 is out of range"),
    ("size over max", "Reserve", pb.ReserveRequest(namespace=NS, keys=[b"a"], sizes=[(4 << 20) + 1]),
     C.INVALID_ARGUMENT, "invalid_request", "blocks are 1..4194304 bytes"),
    ("sizes count", "Reserve", pb.ReserveRequest(namespace=NS, keys=[b"a", b"b"], sizes=[1]),
     C.INVALID_ARGUMENT, "invalid_request", "1 sizes for 2 keys"),
    ("duplicate keys", "Reserve", pb.ReserveRequest(namespace=NS, keys=[b"a", b"a"], sizes=[1, 1]),
     C.INVALID_ARGUMENT, "invalid_request", "duplicate keys"),
    ("oversized batch", "Exists", pb.KeysRequest(namespace=NS, keys=[b"%d" % i for i in range(4097)]),
     C.INVALID_ARGUMENT, "batch_too_large", "exceeds max_batch_keys=4096"),
    ("unknown namespace", "Lookup", pb.LookupRequest(namespace="nobody", keys=[b"a"]),
     C.NOT_FOUND, "unknown_namespace", "unknown namespace 'nobody'"),
    ("bad namespace name", "RegisterNamespace", pb.RegisterNamespaceRequest(name="has space"),
     C.INVALID_ARGUMENT, "invalid_request", "invalid namespace 'has space'"),
    ("namespace conflict", "RegisterNamespace", pb.RegisterNamespaceRequest(name=NS, model="other"),
     C.ALREADY_EXISTS, "conflict", "a different layout needs a different namespace name"),
    ("tokens_per_block zero", "RegisterNamespace", pb.RegisterNamespaceRequest(name="bad/t0", tokens_per_block=0),
     C.INVALID_ARGUMENT, "invalid_request", "tokens_per_block=0 out of range: use 1..1048576"),
    ("tokens_per_block too large", "RegisterNamespace",
     pb.RegisterNamespaceRequest(name="bad/t1", tokens_per_block=(1 << 20) + 1),
     C.INVALID_ARGUMENT, "invalid_request", "tokens_per_block=1048577 out of range: use 1..1048576"),
    ("tokens_per_block conflict", "RegisterNamespace", pb.RegisterNamespaceRequest(name=TOK, tokens_per_block=32),
     C.ALREADY_EXISTS, "conflict", "namespace 'bad/tokens' is registered with tokens_per_block=16, not 32"),
    ("tokens_per_block added later", "RegisterNamespace",
     pb.RegisterNamespaceRequest(name=NS, model="m", tokens_per_block=16),
     C.ALREADY_EXISTS, "conflict", "namespace 'bad/ns' is registered with no tokens_per_block, not 16"),
    ("unknown reservation", "Commit", pb.CommitRequest(reservation_id=12345),
     C.NOT_FOUND, "unknown_reservation", "reservation 12345 is unknown"),
    ("abort unknown", "Abort", pb.AbortRequest(reservation_id=7), C.NOT_FOUND, "unknown_reservation", "unknown"),
    ("list limit", "ListKeys", pb.ListKeysRequest(namespace=NS, limit=20000),
     C.INVALID_ARGUMENT, "invalid_request", "limit 20000 out of range"),
]


@pytest.mark.parametrize("name,rpc,request_,code,reason,text", CASES, ids=[c[0] for c in CASES])
def test_bad_request_status(stub, name, rpc, request_, code, reason, text) -> None:
    got_code, got_reason, details = _status(getattr(stub, rpc), request_)
    assert (got_code, got_reason) == (code, reason)
    assert text in details
    assert stub.Health(pb.HealthRequest(), timeout=5).status == "SERVING"


def test_double_commit_and_wrong_checksum_count(stub) -> None:
    r = stub.Reserve(pb.ReserveRequest(namespace=NS, keys=[b"dc1", b"dc2"], sizes=[10, 10]), timeout=5)
    code, reason, details = _status(stub.Commit, pb.CommitRequest(reservation_id=r.reservation_id, checksums=[1]))
    assert (code, reason) == (C.INVALID_ARGUMENT, "invalid_request")
    assert "1 checksums for a reservation of 2 blocks" in details
    # the bad commit consumed nothing: the reservation still commits
    assert stub.Commit(pb.CommitRequest(reservation_id=r.reservation_id), timeout=5).committed == 2
    code, reason, details = _status(stub.Commit, pb.CommitRequest(reservation_id=r.reservation_id))
    assert (code, reason) == (C.FAILED_PRECONDITION, "reservation_closed")
    assert details == f"reservation {r.reservation_id} was already committed"
    code, _, details = _status(stub.Abort, pb.AbortRequest(reservation_id=r.reservation_id))
    assert code == C.FAILED_PRECONDITION and "already committed" in details


def test_expired_reservation(make_daemon) -> None:
    d = make_daemon(reservation_ttl_s=0.3, quarantine_s=0.1)
    ch, st = raw_stub(d.address)
    with ch:
        st.RegisterNamespace(pb.RegisterNamespaceRequest(name=NS))
        r = st.Reserve(pb.ReserveRequest(namespace=NS, keys=[b"late"], sizes=[100]), timeout=5)
        wait_until(lambda: st.Stats(pb.StatsRequest()).reservations_active == 0, what="reservation expiry")
        code, reason, details = _status(st.Commit, pb.CommitRequest(reservation_id=r.reservation_id))
        assert (code, reason) == (C.FAILED_PRECONDITION, "reservation_closed")
        assert "was already expired" in details and "reservation_ttl_s" in details


def test_malformed_put_streams(stub) -> None:
    hdr = pb.BlockHeader(namespace=NS, key=b"s1", size=10)
    cases = [
        ([pb.PutChunk(data=b"x")], C.INVALID_ARGUMENT, "data before any header"),
        ([pb.PutChunk(header=hdr), pb.PutChunk(data=b"12345")], C.INVALID_ARGUMENT, "5 bytes short"),
        ([pb.PutChunk(header=hdr), pb.PutChunk(data=b"x" * 11)], C.INVALID_ARGUMENT, "1 bytes more"),
        ([pb.PutChunk(header=hdr), pb.PutChunk(header=hdr)], C.INVALID_ARGUMENT, "new header arrived"),
        ([pb.PutChunk()], C.INVALID_ARGUMENT, "empty chunk"),
        ([pb.PutChunk(header=pb.BlockHeader(namespace=NS, key=b"s1", size=10, checksum=99)),
          pb.PutChunk(data=b"0123456789")], C.DATA_LOSS, "checksum mismatch"),
    ]
    before = stub.Stats(pb.StatsRequest(), timeout=5)
    for chunks, code, text in cases:
        got, _, details = _status(stub.Put, iter(chunks))
        assert got == code, details
        assert text in details
    after = stub.Stats(pb.StatsRequest(), timeout=5)
    # nothing half-written stays behind: no reservation, no new block, no allocated bytes
    assert after.reservations_active == 0
    assert after.counters["checksum_failures"] == before.counters["checksum_failures"] + 1
    assert (after.blocks, after.allocated_bytes) == (before.blocks, before.allocated_bytes)
    assert not stub.Exists(pb.KeysRequest(namespace=NS, keys=[b"s1"]), timeout=5).present[0]


def test_client_raises_the_matching_exception_classes(daemon: DaemonProcess, stub) -> None:
    # `stub` registers TOK (tokens_per_block=16): without it, run alone (-k), the conflict below had nothing to meet
    with Client(daemon.address) as c:
        c.register_namespace(NS, model="m")
        with pytest.raises(UnknownNamespaceError):
            c.get("nobody", b"k")
        with pytest.raises(BatchTooLargeError):
            c._rpc.call("Exists", pb.KeysRequest(namespace=NS, keys=[b"%d" % i for i in range(5000)]))  # noqa: SLF001
        with pytest.raises(InvalidRequestError):
            c.put(NS, b"", b"v")
        with pytest.raises(ConflictError):
            c.register_namespace(NS, model="different")
        with pytest.raises(InvalidRequestError, match="tokens_per_block=0 out of range"):
            c.register_namespace("bad/never", tokens_per_block=0)  # checked by the client before any RPC
        with pytest.raises(ConflictError, match="tokens_per_block=16, not 8"):
            c.register_namespace(TOK, tokens_per_block=8)
        assert c.register_namespace(TOK) is False  # not stating it is no conflict
        assert c.register_namespace(TOK, tokens_per_block=16) is False
        with pytest.raises(UnknownReservationError):
            c._rpc.call("Abort", pb.AbortRequest(reservation_id=99))  # noqa: SLF001
        res = c.reserve(NS, [b"once"], [5])
        c.commit(res)
        with pytest.raises(ReservationClosedError):
            c.commit(res)


def test_put_stream_abandoned_mid_block_frees_its_slot_at_once(stub) -> None:
    def chunks():
        yield pb.PutChunk(header=pb.BlockHeader(namespace=NS, key=b"gone", size=1 << 20))
        yield pb.PutChunk(data=b"x" * 1000)
        raise RuntimeError("client dies mid-block")

    with pytest.raises(grpc.RpcError):
        stub.Put(chunks(), timeout=10)
    # reservation_ttl_s is 30 s here: only the daemon noticing the cancelled stream can free it this fast
    wait_until(lambda: stub.Stats(pb.StatsRequest(), timeout=5).reservations_active == 0, timeout_s=5,
               what="abandoned stream's reservation to be aborted")
    assert stub.Stats(pb.StatsRequest(), timeout=5).counters["aborted_blocks"] >= 1
    assert not stub.Exists(pb.KeysRequest(namespace=NS, keys=[b"gone"]), timeout=5).present[0]
