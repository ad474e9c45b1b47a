"""The same-node fast path's wire format: pure encode/decode, no sockets (sans-IO), shared by both ends.

Why a second protocol next to gRPC: on one node, a Python gRPC round trip costs ~0.7 ms and vLLM's scheduler
waits for a Lookup inside its step; a request/response over a unix socket costs ~40 us. The fast path carries
only the hot operations (Lookup, Reserve, Commit, Abort, Release, Exists, and Echo to measure it); everything
else stays gRPC. Both front ends call the same operations (kvstore/server/ops.py), so validation, tenant
checks, errors, metrics and events are one implementation.

A frame, little-endian::

    u32 body length | u8 op | u8 flags | u16 status | u32 request id | body

A connection starts with HELLO (magic, version, whether the caller wants its arena file, its token). The reply
carries the daemon's incarnation and, when asked and allowed, the tenant's arena file as an SCM_RIGHTS
descriptor (kvstore/arena: the only way to reach arena memory). Then any number of requests follow, possibly
pipelined (a client may send several before reading): the daemon answers each in order, with the request's id.
status 0 is a reply; status ERROR (with flag CLOSING when the daemon closes the connection after it) carries `u16 reason length | reason | u32 message length | message`, the
reason being an errors.py class's `reason`, so the client raises the same class the daemon did.

Bodies (n keys; `ns` = u16 length + UTF-8; `keys` = u32 n | u8 k | the keys' bytes back to back, where k is
the length of every key, or 0 followed by u8 length[n] when they differ)::

    LOOKUP   req  flags: 1 prefix, 2 lease,      ns keys
                  4 summary (no lease: counts only, the reply has no hit columns)
             rep  u32 num_prefix | u32 n | u32 hits | u8 present[n] | u8 tiers[n] | u64 lease_id |
                  u32 expires_in_ms | u64 incarnation | u64 offsets[hits] sizes[hits] gens[hits] checksums[hits]
    RESERVE  req  ns keys u64 sizes[n]
             rep  u64 reservation_id | u32 expires_in_ms | u64 incarnation | u32 n | u8 outcomes[n] |
                  u64 offsets[n]
    COMMIT   req  u64 reservation_id | u32 m | u64 checksums[m]        rep  u32 committed
    ABORT    req  u64 reservation_id                                    rep  u32 aborted
    RELEASE  req  u32 m | u64 lease_ids[m]                              rep  u32 released
    EXISTS   req  flags: 1 cluster (keys missing here are asked of their owners),  ns keys
             rep  u32 n | u8 present[n]
    ECHO     req  any bytes (<= 64 KiB)                                 rep  the same bytes
    PROBE    req  ns u32 m | u32 entry_ids[m] | u32 serials[m] | keys
             rep  u32 num_prefix | u32 n | u64 incarnation | u8 tiers[n]   (present: num_prefix Trues, then
                  n - num_prefix Falses, as a prefix Lookup's)
                  a prefix probe (no lease, counts only) whose first m keys the client found in the shared
                  key index (kvstore/fastpath/key_index.py); `keys` are the ones after them, looked up as usual
    LOOKUP_IDS  req  flags as LOOKUP; the PROBE body with no keys: every key of a Lookup found in the index
             rep  as LOOKUP when every entry still holds; an empty body when one does not (nothing was done:
                  the client sends the LOOKUP with its keys)
    HITS     req  as PROBE; no reply: the effects (touches, counters, the miss and its cause) of a Lookup without
                  lease the client answered from the index itself: every key in it (no keys after the ids), or,
                  where the index is authoritative, the prefix it holds followed by the keys it lacks (a PROBE's
                  effects); the daemon checks the ids, logs a refusal.
                  Flag HITS_READ (ids only): the client also copied the blocks out (a get): their bytes count as read
    SPARE, STORE  slots held ahead of a connection's puts, and a put into them in one request: spare_bodies.py

Every length and count is checked against the frame before anything is allocated; a frame that breaks the format
raises FrameError (the daemon answers invalid_request and closes the connection: the byte stream may be out of
step). Limits: a body of at most MAX_BODY bytes; keys 0..255 bytes here (the engine applies its own limits and
messages, exactly as for gRPC).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.fastpath.wire import U32 as _U32
from kvstore.fastpath.wire import U64 as _U64
from kvstore.fastpath.wire import FrameError, Reader
from kvstore.fastpath.wire import keys_field as _keys
from kvstore.fastpath.wire import ns_field as _ns
from kvstore.fastpath.wire import u64s_field as _u64s

__all__ = [
    "HEADER", "HELLO", "LOOKUP", "RESERVE", "COMMIT", "ABORT", "RELEASE", "EXISTS", "EXISTS_CLUSTER", "ECHO", "PROBE", "LOOKUP_IDS",
    "HITS", "HITS_READ", "SPARE", "STORE", "ONE_WAY", "OP_NAMES", "OK", "ERROR", "MAGIC", "VERSION", "MAX_BODY", "HELLO_WANT_INDEX", "FrameError",
    "Header", "Reader", "LookupReply", "frame", "encode_hello", "decode_hello", "encode_hello_reply",
    "decode_hello_reply", "encode_error", "decode_error", "encode_lookup", "decode_lookup", "encode_lookup_reply",
    "decode_lookup_reply", "encode_reserve", "decode_reserve", "encode_reserve_reply", "decode_reserve_reply",
    "encode_commit", "decode_commit", "encode_count", "decode_count", "encode_u64", "decode_u64", "encode_release",
    "decode_release", "encode_exists", "decode_exists", "encode_bools", "decode_bools", "encode_probe",
    "decode_probe", "encode_probe_reply", "decode_probe_reply"]

HEADER = struct.Struct("<IBBHI")
HELLO, LOOKUP, RESERVE, COMMIT, ABORT, RELEASE, EXISTS, ECHO, PROBE, LOOKUP_IDS, HITS, SPARE, STORE = range(1, 14)
OP_NAMES = {HELLO: "Hello", LOOKUP: "Lookup", RESERVE: "Reserve", COMMIT: "Commit", ABORT: "Abort",
            RELEASE: "Release", EXISTS: "Exists", ECHO: "Echo", PROBE: "Probe",
            LOOKUP_IDS: "Lookup", HITS: "Lookup",  # Lookups by entry ids: the same call to the metrics
            SPARE: "Spare", STORE: "Store"}  # spare slots and puts into them: spare_bodies.py
ONE_WAY = frozenset({HITS})  # requests the daemon never answers
OK, ERROR = 0, 1
LOOKUP_PREFIX, LOOKUP_LEASE, LOOKUP_SUMMARY = 1, 2, 4
EXISTS_CLUSTER = 1  # an EXISTS whose local misses are asked of their owners (a daemon without peers ignores it)
HITS_READ = 8  # a HITS of a get: the client read the blocks (hit bytes count, as for a leased Lookup)
CLOSING = 1  # flag of an error reply: the daemon closes the connection after it (bad frame, revoked token)
HELLO_WANT_ARENA, HELLO_WANT_INDEX = 1, 2  # the reply carries the arena file / the key index (one of them)
MAGIC = b"KVFP"
VERSION = 1
MAX_BODY = 4 << 20
MAX_TOKEN_BYTES = 4096
MAX_ECHO = 64 << 10

_HELLO = struct.Struct("<4sHBBI")
_HELLO_REP = struct.Struct("<QI")
_LOOKUP_REP = struct.Struct("<IIIQIQ")  # num_prefix, n, hits, lease_id, expires_in_ms, incarnation (+ arrays)
_RESERVE_REP = struct.Struct("<QIQI")
_COMMIT = struct.Struct("<QI")
_PROBE_REP = struct.Struct("<IIQ")  # num_prefix, n, incarnation (+ tiers)
_U32_LE = np.dtype("<u4")
_NO_KEYS = b"\0\0\0\0\0"  # an empty key list: u32 0 | u8 0


@dataclass(frozen=True)
class Header:
    length: int
    op: int
    flags: int
    status: int
    request_id: int

    @staticmethod
    def parse(data: bytes | bytearray | memoryview) -> Header:
        length, op, flags, status, rid = HEADER.unpack(data)
        if length > MAX_BODY:
            raise FrameError(f"frame body of {length} bytes exceeds {MAX_BODY}")
        if op not in OP_NAMES:
            raise FrameError(f"unknown op {op}")
        return Header(length, op, flags, status, rid)


def frame(op: int, body: bytes | bytearray, request_id: int = 0, *, flags: int = 0, status: int = OK) -> bytes:
    return HEADER.pack(len(body), op, flags, status, request_id) + body


# -- hello and errors ----------------------------------------------------------------------------------------
def encode_hello(token: str, want_arena: bool, want_index: bool = False) -> bytes:
    raw = token.encode("utf-8")
    if len(raw) > MAX_TOKEN_BYTES:
        raise FrameError(f"token of {len(raw)} bytes is longer than {MAX_TOKEN_BYTES}")
    flags = (HELLO_WANT_ARENA if want_arena else 0) | (HELLO_WANT_INDEX if want_index else 0)
    return _HELLO.pack(MAGIC, VERSION, flags, 0, len(raw)) + raw


def decode_hello(body: bytes | memoryview) -> tuple[str, int]:
    """(token, flags: HELLO_WANT_ARENA and/or HELLO_WANT_INDEX)."""
    r = Reader(body)
    magic, version, flags, _, n = _HELLO.unpack(r.take(_HELLO.size))
    if magic != MAGIC:
        raise FrameError("not a kvstore fast-path hello (bad magic)")
    if version != VERSION:
        raise FrameError(f"fast-path version {version}; this daemon speaks {VERSION}")
    if n > MAX_TOKEN_BYTES:
        raise FrameError(f"token of {n} bytes is longer than {MAX_TOKEN_BYTES}")
    token = bytes(r.take(n)).decode("utf-8", "replace")
    r.done()
    if flags & ~(HELLO_WANT_ARENA | HELLO_WANT_INDEX) or flags == HELLO_WANT_ARENA | HELLO_WANT_INDEX:
        raise FrameError(f"hello flags {flags:#x}: ask for the arena file or the key index, not both")
    return token, flags


def encode_hello_reply(incarnation: int, max_batch_keys: int) -> bytes:
    return _HELLO_REP.pack(incarnation, max_batch_keys)


def decode_hello_reply(body: bytes | memoryview) -> tuple[int, int]:
    r = Reader(body)
    inc, mbk = _HELLO_REP.unpack(r.take(_HELLO_REP.size))
    r.done()
    return int(inc), int(mbk)


def encode_error(reason: str, message: str) -> bytes:
    rb, mb = reason.encode()[:255], message.encode()[:16384]
    return len(rb).to_bytes(2, "little") + rb + _U32.pack(len(mb)) + mb


def decode_error(body: bytes | memoryview) -> tuple[str, str]:
    r = Reader(body)
    n = int.from_bytes(r.take(2), "little")
    reason = bytes(r.take(n)).decode("utf-8", "replace")
    message = bytes(r.take(r.u32())).decode("utf-8", "replace")
    return reason, message


# -- lookup -----------------------------------------------------------------------------------------------------
def encode_lookup(ns: str, keys: Sequence[bytes]) -> bytes:
    return _ns(ns) + _keys(keys)


def decode_lookup(body: bytes | memoryview) -> tuple[str, list[bytes]]:
    r = Reader(body)
    ns, keys = r.namespace(), r.keys()
    r.done()
    return ns, keys


def encode_lookup_reply(num_prefix: int, present: Sequence[bool], tiers: Sequence[int], lease_id: int,
                        expires_in_ms: int, incarnation: int, offsets: Sequence[int] | np.ndarray,
                        sizes: Sequence[int] | np.ndarray, generations: Sequence[int] | np.ndarray,
                        checksums: Sequence[int] | np.ndarray) -> bytes:
    n, hits = len(present), len(offsets)
    return b"".join((
        _LOOKUP_REP.pack(num_prefix, n, hits, lease_id, expires_in_ms, incarnation), bytes(present), bytes(tiers),
        _u64s(offsets), _u64s(sizes), _u64s(generations), _u64s(checksums)))


def encode_probe(ns: str, entry_ids: bytes, serials: bytes, keys: Sequence[bytes]) -> bytes:
    """`entry_ids` and `serials`: u32 little-endian each, as IndexView.probe returns them."""
    if len(entry_ids) != len(serials) or len(entry_ids) % 4:
        raise FrameError(f"{len(entry_ids)} bytes of entry ids for {len(serials)} bytes of serials")
    return _ns(ns) + _U32.pack(len(entry_ids) // 4) + entry_ids + serials + _keys(keys)


def decode_probe(body: bytes | memoryview) -> tuple[str, np.ndarray, np.ndarray, list[bytes]]:
    """(namespace, entry ids, serials (uint32 arrays), the keys after them). Unpacked straight from the bytes,
    not through a Reader: it runs inside the scheduler's probe, where a Reader's small calls cost 10 us."""
    b = bytes(body)
    size = len(b)
    n = int.from_bytes(b[:2], "little")
    pos = 2 + n
    if size < pos + 4:
        raise FrameError(f"frame ends {pos + 4 - size} bytes early")
    try:
        ns = b[2:pos].decode("utf-8")
    except UnicodeDecodeError:
        raise FrameError("namespace is not UTF-8") from None
    m = _U32.unpack_from(b, pos)[0]
    pos += 4
    if m * 8 > size - pos:
        raise FrameError(f"{m} entry ids in a frame with {size - pos} bytes left")
    both = np.frombuffer(b, dtype=_U32_LE, count=2 * m, offset=pos)
    pos += 8 * m
    if size - pos == 5 and b[pos:pos + 5] == _NO_KEYS:  # the common case: every key was found in the index
        return ns, both[:m], both[m:], []
    r = Reader(memoryview(b)[pos:])
    keys = r.keys()
    r.done()
    return ns, both[:m], both[m:], keys


def encode_probe_reply(num_prefix: int, tiers: Sequence[int], incarnation: int) -> bytes:
    return _PROBE_REP.pack(num_prefix, len(tiers), incarnation) + bytes(tiers)


def decode_probe_reply(body: bytes | memoryview) -> tuple[int, list[bool], list[int], int]:
    """(num_prefix, present, tiers, incarnation)."""
    if len(body) < _PROBE_REP.size:
        raise FrameError(f"probe reply of {len(body)} bytes")
    num_prefix, n, inc = _PROBE_REP.unpack_from(body)
    if len(body) != _PROBE_REP.size + n or num_prefix > n:
        raise FrameError(f"probe reply of {len(body)} bytes for {n} keys, {num_prefix} of them leading")
    return num_prefix, [True] * num_prefix + [False] * (n - num_prefix), list(body[_PROBE_REP.size:]), inc


@dataclass
class LookupReply:
    num_prefix: int
    present: list[bool]
    tiers: list[int]
    lease_id: int
    expires_in_ms: int
    incarnation: int
    offsets: list[int]
    sizes: list[int]
    generations: list[int]
    checksums: list[int]


def decode_lookup_reply(body: bytes | memoryview) -> LookupReply:
    r = Reader(body)
    num_prefix, n, hits, lease_id, expires, inc = _LOOKUP_REP.unpack(r.take(_LOOKUP_REP.size))
    if hits > n:
        raise FrameError(f"{hits} hits among {n} keys")
    present = list(map(bool, r.take(n)))
    tiers = r.u8s(n)
    cols = [r.u64s(hits) for _ in range(4)]
    r.done()
    return LookupReply(num_prefix, present, tiers, lease_id, expires, inc, *cols)


# -- reserve / commit / abort / release / exists --------------------------------------------------------------
def encode_reserve(ns: str, keys: Sequence[bytes], sizes: Sequence[int]) -> bytes:
    if len(sizes) != len(keys):
        raise FrameError(f"{len(sizes)} sizes for {len(keys)} keys")
    return _ns(ns) + _keys(keys) + _u64s(sizes)


def decode_reserve(body: bytes | memoryview) -> tuple[str, list[bytes], list[int]]:
    r = Reader(body)
    ns, keys = r.namespace(), r.keys()
    sizes = r.u64s(len(keys))
    r.done()
    return ns, keys, sizes


def encode_reserve_reply(reservation_id: int, expires_in_ms: int, incarnation: int, outcomes: Sequence[int],
                         offsets: Sequence[int]) -> bytes:
    return (_RESERVE_REP.pack(reservation_id, expires_in_ms, incarnation, len(outcomes)) + bytes(outcomes)
            + _u64s(offsets))


def decode_reserve_reply(body: bytes | memoryview) -> tuple[int, int, int, list[int], list[int]]:
    r = Reader(body)
    rid, expires, inc, n = _RESERVE_REP.unpack(r.take(_RESERVE_REP.size))
    outcomes = r.u8s(n)
    offsets = r.u64s(n)
    r.done()
    return int(rid), int(expires), int(inc), outcomes, offsets


def encode_commit(reservation_id: int, checksums: Sequence[int]) -> bytes:
    return _COMMIT.pack(reservation_id, len(checksums)) + _u64s(checksums)


def decode_commit(body: bytes | memoryview) -> tuple[int, list[int]]:
    r = Reader(body)
    rid, m = _COMMIT.unpack(r.take(_COMMIT.size))
    checksums = r.u64s(m)
    r.done()
    return int(rid), checksums


def encode_u64(value: int) -> bytes:
    return _U64.pack(value)


def decode_u64(body: bytes | memoryview) -> int:
    r = Reader(body)
    v = r.u64()
    r.done()
    return v


def encode_count(n: int) -> bytes:
    return _U32.pack(n)


def decode_count(body: bytes | memoryview) -> int:
    r = Reader(body)
    v = r.u32()
    r.done()
    return v


def encode_release(lease_ids: Sequence[int]) -> bytes:
    return _U32.pack(len(lease_ids)) + _u64s(lease_ids)


def decode_release(body: bytes | memoryview) -> list[int]:
    r = Reader(body)
    ids = r.u64s(r.u32())
    r.done()
    return ids


def encode_exists(ns: str, keys: Sequence[bytes]) -> bytes:
    return _ns(ns) + _keys(keys)


def decode_exists(body: bytes | memoryview) -> tuple[str, list[bytes]]:
    return decode_lookup(body)


def encode_bools(values: Sequence[bool]) -> bytes:
    return _U32.pack(len(values)) + bytes(values)


def decode_bools(body: bytes | memoryview) -> list[bool]:
    r = Reader(body)
    out = list(map(bool, r.take(r.u32())))
    r.done()
    return out
