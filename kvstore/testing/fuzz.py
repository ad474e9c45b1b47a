"""Random and malformed requests for every RPC of the proto, and random / truncated / oversized frames for the
peer data port: the generator behind the hypothesis fuzz test (tests/test_fuzz.py) and bench.soak.

Requests are built from the proto descriptors, so an RPC added to kvstore.proto is fuzzed without touching
this file. Field values lean towards what reaches deep code (registered namespaces, keys that exist, ids the
daemon issued a moment ago, sizes at the limits) and otherwise are anything the wire allows (any string, any
bytes, any uint64, oversized batches). Randomness comes from a `Source`: `RandomSource` (random.Random, for the
soak) or a hypothesis adapter (the test), so hypothesis can shrink a failing example.

A daemon answer is fine whatever its status, except INTERNAL: the service maps every expected fault to a
status, so INTERNAL means a bug (counted in `FuzzStats.internal`; raw undecodable bytes are expected to get
INTERNAL from grpc's deserializer and are counted apart).
"""

from __future__ import annotations

import builtins
import random
import socket
import struct
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import numpy as np
import xxhash
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor

from kvstore._proto import kvstore_pb2 as pb
from kvstore.hint_vocab import HintAction
from kvstore.peer import frames as fr

__all__ = ["Source", "RandomSource", "Pools", "FuzzStats", "METHODS", "fuzz_rpc", "fuzz_raw", "fuzz_frame"]

METHODS: tuple[MethodDescriptor, ...] = tuple(pb.DESCRIPTOR.services_by_name["KVStore"].methods)
_SERVICE = "/kvstore.v1.KVStore/"


class Source(Protocol):
    def int(self, lo: int, hi: int) -> int: ...
    def choice(self, seq: Sequence[Any]) -> Any: ...
    def bytes(self, max_len: builtins.int) -> builtins.bytes: ...
    def text(self, max_len: builtins.int) -> str: ...


class RandomSource:
    def __init__(self, seed: int | None = None) -> None:
        self.r = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.r.randint(lo, hi)

    def choice(self, seq: Sequence[Any]) -> Any:
        return seq[self.r.randrange(len(seq))]

    def bytes(self, max_len: builtins.int) -> builtins.bytes:
        return self.r.randbytes(self.r.randint(0, max_len))

    def text(self, max_len: builtins.int) -> str:
        alphabet = "abcXYZ019._:/@+=- \t\n\x00é漢\U0001f600"
        return "".join(self.r.choice(alphabet) for _ in range(self.r.randint(0, max_len)))


@dataclass
class Pools:
    """Values worth reusing: registered namespaces, known keys, ids the daemon issued."""

    namespaces: list[str]
    keys: list[bytes] = field(default_factory=lambda: [b"k%d" % i for i in range(16)])
    reservation_ids: list[int] = field(default_factory=list)
    lease_ids: list[int] = field(default_factory=list)
    spare_slots: list[int] = field(default_factory=list)  # offsets a fast-path SPARE granted (its connection's)
    max_block_bytes: int = 1 << 20

    def remember(self, pool: list[int], value: int) -> None:
        if value:
            pool.append(value)
            del pool[:-64]


@dataclass
class FuzzStats:
    calls: Counter = field(default_factory=Counter)     # method -> requests sent
    codes: Counter = field(default_factory=Counter)     # status code name -> count
    internal: list[str] = field(default_factory=list)   # INTERNAL answers to well-formed requests (bugs)
    raw_calls: int = 0                                  # undecodable byte strings sent as requests
    frames: int = 0                                     # frames sent to the peer data port

    @property
    def rpcs(self) -> int:
        return sum(self.calls.values()) + self.raw_calls


# -- request generation ------------------------------------------------------------------------------------
def _namespace(src: Source, pools: Pools) -> str:
    if src.int(0, 9) < 8:
        return src.choice(pools.namespaces)
    return src.choice([src.text(30), "x" * src.int(190, 260), "", "ns with space", "fz/" + src.text(8)])


def _key(src: Source, pools: Pools) -> bytes:
    if src.int(0, 9) < 7:
        return src.choice(pools.keys)
    return src.choice([src.bytes(80), b"", b"\x00" * 64, b"y" * 65])


def _size(src: Source, pools: Pools) -> int:
    m = pools.max_block_bytes
    return src.choice([1, 100, 4096, 65536, m, m + 1, 0, 2**63, 2**64 - 1, src.int(0, 2**64 - 1),
                       src.int(1, 8192)])


def _from_pool(src: Source, pool: list[int]) -> int | None:
    """A recently issued id, 2 times in 3. The draws never depend on the pool's state (hypothesis replays
    a prefix of draws and requires the same structure), only the value does."""
    use, idx = src.int(0, 2), src.int(0, 63)
    return pool[idx % len(pool)] if use and pool else None


def _u64(src: Source, pools: Pools, name: str) -> int:
    if name in ("size", "sizes"):
        return _size(src, pools)
    any_value = src.choice([0, 1, src.int(0, 2**64 - 1), 2**64 - 1])
    if name in ("reservation_id", "lease_ids"):
        got = _from_pool(src, pools.reservation_ids if name == "reservation_id" else pools.lease_ids)
        if got is not None:
            return got
    return any_value


def _length(src: Source) -> int:
    return src.choice([0, 1, 1, 2, 3, 5, 8, src.int(0, 40), 4097])


def _scalar(fd: FieldDescriptor, src: Source, pools: Pools) -> Any:
    name, t = fd.name, fd.type
    if t == FieldDescriptor.TYPE_STRING:
        if name in ("namespace", "name", "namespaces"):
            return _namespace(src, pools)
        if name == "disk_codec":
            return src.choice(["", "none", "zstd", "zstd-shuffle2", src.text(10)])
        if name == "action":  # HintRequest: every action (so outcomes are reached), odd case, and junk
            return src.choice([*(a.value for a in HintAction), "PIN", "Retain", "", src.text(12)])
        return src.choice(["", "m", src.text(20), "t" * src.int(250, 300)])
    if t == FieldDescriptor.TYPE_BYTES:
        return b"" if name == "data" else _key(src, pools)
    if t == FieldDescriptor.TYPE_BOOL:
        return bool(src.int(0, 1))
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return _u64(src, pools, name)
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return src.choice([0, 1, 16, 1000, 10000, 10001, (1 << 20) + 1, 2**32 - 1, src.int(0, 2**32 - 1)])
    if t == FieldDescriptor.TYPE_ENUM:
        return src.int(0, 5)
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT32):
        return src.int(-(2**31), 2**31 - 1)
    if t == FieldDescriptor.TYPE_DOUBLE:
        if name == "ttl_s":  # HintRequest: a usable ttl, one past hint_max_ttl_s (clipped), and bad ones
            return src.choice([0.0, 0.5, 5.0, 1e9, -1.0, 1e308, float("inf"), float("nan")])
        return src.choice([0.0, -1.0, 1e308, float("nan")])
    raise TypeError(f"no generator for field {fd.full_name} of type {t}")


def make_message(desc: Descriptor, src: Source, pools: Pools, depth: int = 0) -> Any:
    msg = pb.__dict__.get(desc.name) or getattr(pb, desc.name)
    out = msg()
    oneofs = {o.name: o.fields for o in desc.oneofs}
    chosen = {name: src.choice(fields) for name, fields in oneofs.items()}
    for fd in desc.fields:
        if fd.containing_oneof is not None and chosen[fd.containing_oneof.name] is not fd:
            continue
        if src.int(0, 9) == 0:  # leave it unset now and then
            continue
        if fd.type == FieldDescriptor.TYPE_MESSAGE:
            if depth < 2 and not fd.message_type.GetOptions().map_entry:
                if fd.is_repeated:  # e.g. AnnotateRequest.origins: a few messages of their own
                    items = getattr(out, fd.name)
                    for _ in range(min(_length(src), 4)):
                        items.add().CopyFrom(make_message(fd.message_type, src, pools, depth + 1))
                else:
                    getattr(out, fd.name).CopyFrom(make_message(fd.message_type, src, pools, depth + 1))
            continue
        if fd.is_repeated:
            n = _length(src)
            getattr(out, fd.name).extend(_scalar(fd, src, pools) for _ in range(n))
        else:
            setattr(out, fd.name, _scalar(fd, src, pools))
    return out


def _put_chunks(src: Source, pools: Pools) -> list[pb.PutChunk]:
    """A Put stream: mostly well-formed groups (header + exactly its bytes, right or wrong checksum), with
    missing, extra, short and stray chunks mixed in."""
    out: list[pb.PutChunk] = []
    for _ in range(src.int(0, 4)):
        kind = src.int(0, 9)
        if kind < 6:
            size = src.choice([1, 100, 5000, src.int(1, 70000)])
            data = bytes([src.int(0, 255)]) * size
            good = src.int(0, 3) > 0
            header = pb.BlockHeader(namespace=_namespace(src, pools), key=_key(src, pools), size=size,
                                    checksum=xxhash.xxh3_64_intdigest(data) if good else src.int(0, 2**64 - 1))
            out.append(pb.PutChunk(header=header))
            cut = src.int(0, size)
            for part in (data[:cut], data[cut:]):
                if part:
                    out.append(pb.PutChunk(data=part))
            if src.int(0, 9) == 0:
                out.pop()  # the group ends short
        elif kind < 8:
            out.append(make_message(pb.PutChunk.DESCRIPTOR, src, pools))
        else:
            out.append(pb.PutChunk(data=src.bytes(100)))
    return out


def fuzz_rpc(channel: grpc.Channel, method: MethodDescriptor, src: Source, pools: Pools, stats: FuzzStats,
             metadata: tuple = (), timeout_s: float = 5.0) -> None:
    """One random request to `method`; harvests ids the daemon issues; records the status."""
    path = _SERVICE + method.name
    out_cls = getattr(pb, method.output_type.name)
    stats.calls[method.name] += 1
    code = grpc.StatusCode.OK
    try:
        if method.client_streaming:
            call = channel.stream_unary(path, request_serializer=pb.PutChunk.SerializeToString,
                                        response_deserializer=out_cls.FromString)
            call(iter(_put_chunks(src, pools)), timeout=timeout_s, metadata=metadata)
        elif method.server_streaming:
            req = make_message(method.input_type, src, pools)
            call = channel.unary_stream(path, request_serializer=type(req).SerializeToString,
                                        response_deserializer=out_cls.FromString)
            stream = call(req, timeout=0.5 if method.name == "Subscribe" else timeout_s, metadata=metadata)
            try:
                for i, _ in enumerate(stream):
                    if i >= 64:
                        break
            finally:
                stream.cancel()
        else:
            req = make_message(method.input_type, src, pools)
            call = channel.unary_unary(path, request_serializer=type(req).SerializeToString,
                                       response_deserializer=out_cls.FromString)
            resp = call(req, timeout=timeout_s, metadata=metadata)
            if method.name == "Reserve":
                pools.remember(pools.reservation_ids, resp.reservation_id)
            elif method.name == "Lookup":
                pools.remember(pools.lease_ids, resp.lease_id)
    except grpc.RpcError as err:
        code = err.code()
        if code == grpc.StatusCode.INTERNAL:
            stats.internal.append(f"{method.name}: {err.details()}")
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED and method.name == "Subscribe":
            code = grpc.StatusCode.OK  # a quiet event stream that our short deadline ended
        elif code == grpc.StatusCode.CANCELLED:
            code = grpc.StatusCode.OK  # we cancelled a stream we had read enough of
    stats.codes[code.name] += 1


def fuzz_raw(channel: grpc.Channel, method: MethodDescriptor, src: Source, stats: FuzzStats,
             metadata: tuple = ()) -> None:
    """Arbitrary bytes as the serialized request (most do not decode; some decode to odd messages)."""
    path = _SERVICE + method.name
    stats.raw_calls += 1
    payload = src.bytes(200)
    try:
        if method.client_streaming:
            channel.stream_unary(path)(iter([payload, src.bytes(50)]), timeout=5, metadata=metadata)
        elif method.server_streaming:
            stream = channel.unary_stream(path)(payload, timeout=0.5, metadata=metadata)
            for i, _ in enumerate(stream):
                if i >= 8:
                    break
            stream.cancel()
        else:
            channel.unary_unary(path)(payload, timeout=5, metadata=metadata)
        stats.codes["OK"] += 1
    except grpc.RpcError as err:
        stats.codes["raw:" + err.code().name] += 1


# -- peer data-plane frames ---------------------------------------------------------------------------------
def make_frame(src: Source, pools: Pools) -> bytes:
    """A frame that is random, truncated, oversized, lying about its sizes, or (sometimes) well-formed."""
    kind = src.int(0, 7)
    ns = _namespace(src, pools)
    keys = [_key(src, pools) or b"k" for _ in range(src.int(0, 4))]
    if kind == 0:
        return src.bytes(200)
    if kind == 1:  # a header with arbitrary fields
        return fr.HEADER.pack(src.choice([fr.MAGIC, b"JUNK"]), src.choice([1, 1, 2, 255]), src.int(0, 7),
                              src.int(0, 65535), src.int(0, 2**64 - 1), src.int(0, 2**32 - 1),
                              src.int(0, 2**32 - 1), src.int(0, 2**64 - 1)) + src.bytes(64)
    if kind in (2, 3):  # a fetch or a probe (same metadata), whole or cut anywhere
        try:
            meta = fr.encode_fetch(ns, [k[:255] for k in keys])
        except struct.error:
            meta = b""
        op = src.choice([fr.FETCH, fr.PROBE])
        frame = fr.Header(op, src.int(1, 1000), len(keys), len(meta), src.choice([0, 0, 0, 7])).pack() + meta
        return frame if kind == 2 else frame[:src.int(0, len(frame))]
    # a push: sizes honest or lying, payload complete, short or long, checksums right or wrong
    sizes = np.array([src.choice([1, 100, 4096, pools.max_block_bytes + 1, src.int(1, 9000)]) for _ in keys],
                     dtype=np.int64)
    payload = b"".join(bytes([src.int(0, 255)]) * int(s) for s in sizes if s <= 1 << 20)
    sums = np.array([src.int(0, 2**64 - 1) for _ in keys], dtype=np.uint64)
    if kind == 4 and len(keys):
        sums = np.array([xxhash.xxh3_64_intdigest(bytes([payload[0]]) * int(s)) if payload else 0 for s in sizes],
                        dtype=np.uint64)
    try:
        meta = fr.encode_push(fr.NamespaceDesc(ns, tenant=src.choice(["", "t", "x" * 300])),
                              [k[:255] for k in keys], sizes, sums)
    except (struct.error, ValueError, OverflowError):
        meta = b""
    declared = int(sizes.sum()) + src.choice([0, 0, 0, 1, -1])
    frame = fr.Header(fr.PUSH, src.int(1, 1000), len(keys), len(meta), max(0, declared)).pack() + meta + payload
    return frame if kind != 7 else frame[:src.int(0, len(frame))]


def fuzz_frame(address: tuple[str, int], src: Source, pools: Pools, stats: FuzzStats, timeout_s: float = 2.0) -> None:
    """Send one frame on a fresh connection, read whatever comes back until the daemon closes or goes quiet."""
    frame = make_frame(src, pools)
    stats.frames += 1
    try:
        with socket.create_connection(address, timeout=timeout_s) as s:
            s.sendall(frame)
            if src.int(0, 1):
                s.shutdown(socket.SHUT_WR)
            s.settimeout(0.2)
            try:
                while s.recv(65536):
                    pass
            except (TimeoutError, ConnectionError):
                pass
    except OSError:
        pass  # the daemon may close mid-send: that is the expected answer to garbage
