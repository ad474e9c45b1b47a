"""The peer protocol on its own (kvstore/peer/protocol.py): no sockets, no event loop, a small in-memory store.

Every request kind goes client -> serve -> client through the real builders, serve() and validators, with the
bytes the wire would carry; every malformed header, metadata section and reply the validators must reject is
listed with the message it must raise. The planes that move these bytes are tested in test_peer_deadlines.py
and test_peer_plane_replies.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvstore.peer import frames as fr
from kvstore.peer import protocol as proto
from kvstore.peer.frames import FrameError, Header, NamespaceDesc
from kvstore.peer.local import Incoming, Outgoing

LIMITS = proto.Limits(max_keys=4, max_block_bytes=4096)
NS = "m@d/t"
DESC = NamespaceDesc(NS, "m", "d", "t", 16)
PEER = Path(proto.__file__).parent


def xxh(b: bytes) -> int:
    return xxhash.xxh3_64_intdigest(b)


class FakeLocal:
    """An in-memory local store: namespace -> {key: bytes}. Counts the leases open and every call made."""

    def __init__(self, blocks: dict[str, dict[bytes, bytes]]) -> None:
        self.blocks = blocks
        self.leases_open = 0
        self.calls: list[str] = []

    def open_for_send(self, namespace: str, keys: list[bytes]) -> Outgoing:
        self.calls.append("open_for_send")
        held = self.blocks.get(namespace, {})
        sizes = np.array([len(held.get(k, b"")) for k in keys], dtype=np.int64)
        sums = np.array([xxh(held[k]) if k in held else 0 for k in keys], dtype=np.uint64)
        self.leases_open += 1
        return Outgoing(sizes, sums, [memoryview(held[k]) for k in keys if k in held], self._release)

    def _release(self) -> None:
        self.leases_open -= 1

    def present(self, namespace: str, keys: list[bytes]) -> list[bool]:
        self.calls.append("present")
        held = self.blocks.get(namespace, {})
        return [k in held for k in keys]


@pytest.fixture
def local() -> FakeLocal:
    return FakeLocal({NS: {b"a": b"A" * 5, b"c": b"C" * 7}})


def server_side(raw: bytes, local: FakeLocal) -> proto.Answer | proto.Intake:
    """What a plane's server does with one request frame's header + metadata bytes."""
    h = proto.parse_request(raw[:fr.HEADER.size], LIMITS)
    return proto.serve(h, raw[fr.HEADER.size:], local, LIMITS)


# -- every request kind, both sides ---------------------------------------------------------------------
def test_fetch_round_trip(local: FakeLocal) -> None:
    keys = [b"a", b"miss", b"c"]
    req = proto.fetch_request(7, NS, keys)
    assert req.header == Header(fr.FETCH, 7, 3, len(req.meta), 0)
    answer = server_side(req.pack(), local)
    assert isinstance(answer, proto.Answer)
    assert answer.frame.header == Header(fr.FETCH_REPLY, 7, 3, 48, 12)
    assert (answer.served_blocks, answer.payload_bytes, local.leases_open) == (2, 12, 1)
    assert [bytes(v) for v in answer.blocks.views] == [b"A" * 5, b"C" * 7]  # type: ignore[union-attr]  # a FETCH answer carries its blocks
    answer.close()
    assert local.leases_open == 0
    reply = proto.parse_reply(answer.frame.header.pack(), req.header, LIMITS)
    plan = proto.fetch_plan(reply, answer.frame.meta, NS, keys, LIMITS)
    assert (plan.namespace, plan.keys, plan.sizes, plan.desc) == (NS, [b"a", b"c"], [5, 7], None)
    assert plan.checksums.tolist() == [xxh(b"A" * 5), xxh(b"C" * 7)]
    assert plan.payload_bytes == 12


def test_a_fetch_of_nothing_held_answers_an_empty_payload(local: FakeLocal) -> None:
    req = proto.fetch_request(3, "never-registered", [b"a", b"b"])
    answer = server_side(req.pack(), local)
    assert isinstance(answer, proto.Answer)
    assert (answer.frame.header, answer.served_blocks) == (Header(fr.FETCH_REPLY, 3, 2, 32, 0), 0)
    answer.close()
    plan = proto.fetch_plan(proto.parse_reply(answer.frame.header.pack(), req.header, LIMITS), answer.frame.meta,
                            "never-registered", [b"a", b"b"], LIMITS)
    assert (plan.keys, plan.sizes, plan.landing(None)) == ([], [], [])


def test_probe_round_trip(local: FakeLocal) -> None:
    req = proto.probe_request(8, NS, [b"c", b"miss", b"a"])
    answer = server_side(req.pack(), local)
    assert isinstance(answer, proto.Answer)
    assert (answer.frame.header, answer.frame.meta) == (Header(fr.PROBE_REPLY, 8, 3, 3, 0), b"\x01\x00\x01")
    assert (answer.blocks, answer.served_blocks, local.calls, local.leases_open) == (None, 0, ["present"], 0)
    reply = proto.parse_reply(answer.frame.header.pack(), req.header, LIMITS)
    assert proto.probe_result(reply, answer.frame.meta) == [True, False, True]


@pytest.mark.parametrize("keys", [
    [b"k%015d" % i for i in range(64)],                       # one length: the sliced fast path
    [b"k%015d" % i for i in range(63)] + [b"short"],          # the last length differs: the per-key loop
    [b"x" * 255, b"y" * 255], [b"a"], [b"ab", b"c", b"de"],
])
def test_key_batches_encode_as_length_prefixed_keys_and_decode_exactly(keys: list[bytes]) -> None:
    meta = fr.encode_fetch(NS, keys)
    assert meta == fr.encode_fetch(NS, []) + b"".join(bytes([len(k)]) + k for k in keys)
    assert fr.decode_fetch(meta, len(keys)) == (NS, keys)
    with pytest.raises(FrameError, match="metadata shorter than its fields"):
        fr.decode_fetch(meta[:-1], len(keys))
    with pytest.raises(FrameError, match="1 unexpected bytes after the metadata"):
        fr.decode_fetch(meta + b"!", len(keys))
    with pytest.raises(FrameError, match="unexpected bytes after the metadata"):
        fr.decode_fetch(meta, len(keys) - 1) if len(keys) > 1 else fr.decode_fetch(meta + b"\x01z", 1)


def test_push_round_trip_sends_only_the_blocks_held_and_serve_touches_nothing(local: FakeLocal) -> None:
    keys = [b"k1", b"k2", b"k3"]
    sizes, sums = np.array([3, 0, 4]), np.array([11, 0, 33], dtype=np.uint64)
    req = proto.push_request(9, DESC, keys, sizes, sums)
    assert req is not None and req.header == Header(fr.PUSH, 9, 2, len(req.meta), 7)
    intake = server_side(req.pack(), local)
    assert isinstance(intake, proto.Intake)
    assert local.calls == []  # slots are reserved by the plane when it runs the plan
    plan = intake.plan
    assert (intake.request_id, plan.namespace, plan.keys, plan.sizes) == (9, NS, [b"k1", b"k3"], [3, 4])
    assert plan.desc == DESC
    assert plan.checksums.tolist() == [11, 33]
    stored = intake.reply(2)
    assert (stored.header, stored.meta) == (Header(fr.PUSH_REPLY, 9, 2, 0, 0), b"")
    assert proto.push_result(proto.parse_reply(stored.pack(), req.header, LIMITS)) == 2
    assert proto.push_result(proto.parse_reply(intake.reply(0).pack(), req.header, LIMITS)) == 0


def test_a_push_of_nothing_held_is_no_request() -> None:
    assert proto.push_request(1, DESC, [b"k1", b"k2"], np.array([0, 0]), np.zeros(2, dtype=np.uint64)) is None
    with pytest.raises(ValueError, match="3 blocks stored of a push of 2"):
        proto.Intake(1, proto.ReceivePlan(NS, [b"a", b"b"], [1, 1], np.zeros(2, dtype=np.uint64))).reply(3)


# -- the receive plan: which bytes land where ------------------------------------------------------------
def test_the_receive_plan_lands_each_block_in_its_slot_or_scratch() -> None:
    plan = proto.ReceivePlan.of(NS, [b"a", b"b", b"c", b"d"], np.array([5, 0, 7, 3]),
                                np.array([1, 0, 2, 3], dtype=np.uint64))
    assert (plan.keys, plan.sizes, plan.checksums.tolist(), plan.payload_bytes) == ([b"a", b"c", b"d"], [5, 7, 3],
                                                                                    [1, 2, 3], 15)
    assert plan.landing(None) == [(None, 5), (None, 7), (None, 3)]     # no reservation: all read and dropped
    slot_a, slot_d = memoryview(bytearray(5)), memoryview(bytearray(3))
    inc = Incoming([slot_a, None, slot_d], reservation_id=1)          # c already present: dropped
    assert plan.landing(inc) == [(slot_a, 5), (None, 7), (slot_d, 3)]
    assert [plan.left_after(0, 2), plan.left_after(1, 0), plan.left_after(2, 3)] == [13, 10, 0]
    with pytest.raises(ValueError, match="2 reserved slots for a plan of 3 blocks"):
        plan.landing(Incoming([slot_a, slot_d], reservation_id=1))
    with pytest.raises(ValueError, match="a reserved slot of 3 bytes for a block of 5"):
        plan.landing(Incoming([slot_d, None, slot_d], reservation_id=1))


# -- requests the server must reject ---------------------------------------------------------------------
def _h(op: int, count: int = 1, meta_len: int = 0, payload: int = 0, *, magic: bytes = fr.MAGIC,
       version: int = fr.VERSION, rid: int = 1) -> bytes:
    return fr.HEADER.pack(magic, version, op, 0, rid, count, meta_len, payload)


@pytest.mark.parametrize("raw, message", [
    (_h(fr.FETCH)[:20], "truncated header: 20 of 32 bytes"),
    (_h(fr.FETCH, magic=b"HTTP"), "bad magic"),
    (_h(fr.FETCH, version=2), "unsupported version 2"),
    (_h(fr.FETCH_REPLY), "unexpected op 2"),
    (_h(fr.PUSH_REPLY), "unexpected op 4"),
    (_h(9), "unexpected op 9"),
    (_h(fr.FETCH, count=5), "5 keys in one frame \\(max 4\\)"),
    (_h(fr.PROBE, meta_len=fr.MAX_META_BYTES + 1), "metadata of 1048577 bytes"),
    (_h(fr.PUSH, count=1, payload=4097), "payload of 4097 bytes for 1 blocks of at most 4096"),
    (_h(fr.FETCH, payload=10), "a fetch carries no payload \\(got 10 bytes\\)"),
    (_h(fr.PROBE, payload=1), "a probe carries no payload \\(got 1 bytes\\)"),
])
def test_bad_request_headers_are_rejected(raw: bytes, message: str) -> None:
    with pytest.raises(FrameError, match=message):
        proto.parse_request(raw, LIMITS)


def _push_meta(sizes: list[int], keys: list[bytes] | None = None) -> bytes:
    keys = keys if keys is not None else [b"k%d" % i for i in range(len(sizes))]
    return fr.encode_push(DESC, keys, np.array(sizes), np.zeros(len(sizes), dtype=np.uint64))


@pytest.mark.parametrize("header, meta, message", [
    (Header(fr.FETCH, 1, 1, 0, 0), fr.encode_fetch(NS, [b"abc"])[:-1], "metadata shorter than its fields"),
    (Header(fr.PROBE, 1, 1, 0, 0), fr.encode_fetch(NS, [b"abc"]) + b"!", "1 unexpected bytes after the metadata"),
    (Header(fr.FETCH, 1, 2, 0, 0), fr.encode_fetch(NS, [b"abc"]), "metadata shorter than its fields"),
    (Header(fr.FETCH, 1, 1, 0, 0), fr.encode_fetch(NS, [b""]), "empty key"),
    (Header(fr.PROBE, 1, 1, 0, 0), b"\x02\x00\xff\xfe\x01k", "a string field is not UTF-8"),
    (Header(fr.PUSH, 1, 2, 0, 9), _push_meta([4, 4]), "block sizes add up to 8, the header says 9"),
    (Header(fr.PUSH, 1, 1, 0, 5000), _push_meta([5000]), "a block of 5000 bytes \\(max 4096\\)"),
    (Header(fr.PUSH, 1, 2, 0, 4), _push_meta([4]), "size table of 11 bytes for 2 keys"),  # key 2 ate the table
    (Header(fr.PUSH, 1, 1, 0, 4), _push_meta([4]) + bytes(8), "size table of 24 bytes for 1 keys"),
    (Header(fr.FETCH_REPLY, 1, 1, 0, 0), b"", "op 2 is not a request"),
    (Header(fr.FETCH, 1, 1, 0, 3), fr.encode_fetch(NS, [b"abc"]), "a fetch carries no payload"),
])
def test_bad_request_metadata_is_rejected_and_no_lease_stays_open(local: FakeLocal, header: Header, meta: bytes,
                                                                   message: str) -> None:
    with pytest.raises(FrameError, match=message):
        proto.serve(header, meta, local, LIMITS)
    assert local.leases_open == 0


# -- replies the client must reject ----------------------------------------------------------------------
FETCH3 = Header(fr.FETCH, 7, 3, 20, 0)
PROBE2 = Header(fr.PROBE, 8, 2, 20, 0)
PUSH2 = Header(fr.PUSH, 9, 2, 40, 100)


@pytest.mark.parametrize("request_header, raw, message", [
    (FETCH3, _h(fr.PROBE_REPLY, 3, 3, rid=7), "unexpected op 6"),
    (FETCH3, _h(fr.FETCH, 3, 48, rid=7), "unexpected op 1"),
    (FETCH3, _h(fr.FETCH_REPLY, 3, 48, rid=8), "fetch reply for request 8; expected request 7"),
    (FETCH3, _h(fr.FETCH_REPLY, 2, 32, rid=7), "fetch reply with 2 keys for a request of 3"),
    (FETCH3, _h(fr.FETCH_REPLY, 4, 64, rid=7), "fetch reply with 4 keys for a request of 3"),
    (FETCH3, _h(fr.FETCH_REPLY, 3, 47, rid=7), "fetch reply with 47 bytes of metadata for 3 keys \\(expected 48\\)"),
    (FETCH3, _h(fr.FETCH_REPLY, 3, 48, 3 * 4096 + 1, rid=7), "payload of 12289 bytes for 3 blocks"),
    (FETCH3, _h(fr.FETCH_REPLY, 5, 80, rid=7), "5 keys in one frame"),
    (PROBE2, _h(fr.PROBE_REPLY, 2, 2, rid=1), "probe reply for request 1; expected request 8"),
    (PROBE2, _h(fr.PROBE_REPLY, 1, 1, rid=8), "probe reply with 1 keys for a request of 2"),
    (PROBE2, _h(fr.PROBE_REPLY, 2, 3, rid=8), "probe reply with 3 bytes of metadata for 2 keys \\(expected 2\\)"),
    (PROBE2, _h(fr.PROBE_REPLY, 2, 2, 5, rid=8), "a probe reply carries no payload \\(got 5 bytes\\)"),
    (PUSH2, _h(fr.PUSH_REPLY, 3, rid=9), "push reply says 3 blocks stored of the 2 pushed"),
    (PUSH2, _h(fr.PUSH_REPLY, 2, rid=10), "push reply for request 10; expected request 9"),
    (PUSH2, _h(fr.PUSH_REPLY, 2, 4, rid=9), "a push reply carries no metadata or payload \\(got 4 and 0 bytes\\)"),
    (PUSH2, _h(fr.PUSH_REPLY, 2, 0, 10, rid=9), "a push reply carries no metadata or payload \\(got 0 and 10 bytes\\)"),
    (PUSH2, _h(fr.PUSH_REPLY, 2, rid=9)[:31], "truncated header"),
    (PUSH2, _h(fr.PUSH_REPLY, 2, rid=9, version=0), "unsupported version 0"),
])
def test_bad_replies_are_rejected(request_header: Header, raw: bytes, message: str) -> None:
    with pytest.raises(FrameError, match=message):
        proto.parse_reply(raw, request_header, LIMITS)


def test_good_replies_pass_at_every_bound() -> None:
    assert proto.parse_reply(_h(fr.FETCH_REPLY, 3, 48, 3 * 4096, rid=7), FETCH3, LIMITS).payload_len == 3 * 4096
    assert proto.parse_reply(_h(fr.PROBE_REPLY, 2, 2, rid=8), PROBE2, LIMITS).count == 2
    assert [proto.push_result(proto.parse_reply(_h(fr.PUSH_REPLY, n, rid=9), PUSH2, LIMITS)) for n in (0, 1, 2)] \
        == [0, 1, 2]
    with pytest.raises(ValueError, match="op 2 is not a request"):
        proto.parse_reply(_h(fr.FETCH_REPLY, 3, 48, rid=7), Header(fr.FETCH_REPLY, 7, 3, 48, 0), LIMITS)


@pytest.mark.parametrize("meta, payload, keys, message", [
    (fr.encode_sizes(np.array([5, 7]), np.zeros(2, dtype=np.uint64)), 13, [b"a", b"b"], "to 12, the header says 13"),
    (fr.encode_sizes(np.array([5000, 0]), np.zeros(2, dtype=np.uint64)), 5000, [b"a", b"b"], "a block of 5000 bytes"),
    (fr.encode_sizes(np.array([5, 7]), np.zeros(2, dtype=np.uint64)), 12, [b"a"], "2 keys for a request of 1"),
    (bytes(31), 0, [b"a", b"b"], "size table of 31 bytes for 2 keys"),
])
def test_bad_fetch_reply_size_tables_are_rejected(meta: bytes, payload: int, keys: list[bytes], message: str) -> None:
    with pytest.raises(FrameError, match=message):
        proto.fetch_plan(Header(fr.FETCH_REPLY, 1, 2, len(meta), payload), meta, NS, keys, LIMITS)


def test_bad_presence_tables_are_rejected() -> None:
    with pytest.raises(FrameError, match="a presence byte other than 0 or 1"):
        proto.probe_result(Header(fr.PROBE_REPLY, 1, 2, 2, 0), b"\x01\x02")
    with pytest.raises(FrameError, match="presence table of 1 bytes for 2 keys"):
        proto.probe_result(Header(fr.PROBE_REPLY, 1, 2, 1, 0), b"\x01")


# -- the seam: the protocol does no I/O, the planes decode nothing themselves -----------------------------
def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return names | {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}


def test_the_protocol_module_does_no_io() -> None:
    io = {"socket", "ssl", "select", "selectors", "asyncio", "threading", "ucxx", "kvstore.peer.sockio"}
    assert _imports(PEER / "protocol.py") & io == set()


@pytest.mark.parametrize("plane", ["tcp_plane.py", "tcp_server.py", "tcp_blocks.py", "ucx_plane.py"])
def test_the_planes_build_and_check_no_frame_themselves(plane: str) -> None:
    """Header construction and every codec/validator call go through protocol.py, so the planes cannot drift."""
    tree = ast.parse((PEER / plane).read_text())
    codec = {n for n in fr.__all__ if n.startswith(("encode_", "decode_", "check_")) or n == "Header"}
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "fr"}
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert (used | called) & codec == set()
