"""The peer wire format: one fixed header, a metadata section, then raw block bytes.

    header (32 bytes, little endian)
      magic     4s   b"KVSP"
      version   u8   1
      op        u8   FETCH | FETCH_REPLY | PUSH | PUSH_REPLY | PROBE | PROBE_REPLY
      flags     u16  HANDOFF (1) on a PUSH that hands blocks to their new owner after a membership change;
                     TIERS (2) on a PROBE that asks for each key's tier, and on its reply;
                     CLAIM (4) on a PROBE that claims the keys it misses (kvstore/engine/claims.py), and on its reply;
                     every other bit is reserved (a frame with one set is refused)
      request   u64  request id; a reply carries its request's id
      count     u32  keys in the batch (<= max_batch_keys)
      meta_len  u32  bytes of metadata after the header (<= MAX_META_BYTES)
      payload   u64  bytes of block data after the metadata (= sum of the block sizes)

    FETCH        meta: namespace, keys                       payload: none
    FETCH_REPLY  meta: per key (size u64, xxh3 u64); 0 = miss payload: the found blocks, in key order
    PUSH         meta: namespace description, keys, per key (size u64, xxh3 u64)   payload: the blocks
    PUSH_REPLY   meta: none; count = blocks the receiver stored
    PROBE        meta: namespace, keys                       payload: none
    PROBE_REPLY  meta: one byte per key, 1 = held here (RAM or disk), 0 = not       payload: none
                 with TIERS: one byte per key, its tier here: 0 none, 1 RAM, 2 disk (kvstore.vocab.Tier)
    PROBE+CLAIM  meta: namespace, keys, claimant (u8-length-prefixed), ttl_ms u32   payload: none
    PROBE_REPLY+CLAIM  meta: one byte per key, 0 = claimed for the caller, 1 = held, 2 = pending (another's claim)

This file is the codec (bytes <-> fields, each field checked); what a request or reply must contain relative
to the request it answers, and what a server does with it, is protocol.py's. Strings are u16-length-prefixed
UTF-8, keys u8-length-prefixed. Every field is checked against the limits before anything is allocated or
read: a frame that breaks one raises FrameError, and the receiver closes that connection (it cannot
resynchronise a byte stream) and counts it. Why a home-made frame and not protobuf:
the payload must be read with recv_into straight into arena slots, so the metadata has to say the sizes
before the bytes arrive, and the bytes must not pass through a message object.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

__all__ = ["Header", "FrameError", "NamespaceDesc", "HEADER", "MAGIC", "VERSION", "FETCH", "FETCH_REPLY", "PUSH", "HANDOFF",
           "PUSH_REPLY", "PROBE", "PROBE_REPLY", "TIERS", "CLAIM", "encode_claim", "decode_claim", "decode_claim_states", "MAX_META_BYTES", "encode_presence", "decode_presence",
           "encode_tiers", "decode_tiers",
           "encode_fetch", "decode_fetch", "encode_sizes", "decode_sizes", "encode_push", "decode_push",
           "check_header"]

MAGIC = b"KVSP"
VERSION = 1
FETCH, FETCH_REPLY, PUSH, PUSH_REPLY, PROBE, PROBE_REPLY = 1, 2, 3, 4, 5, 6
_OPS = (FETCH, FETCH_REPLY, PUSH, PUSH_REPLY, PROBE, PROBE_REPLY)
HANDOFF = 1          # flags: this PUSH hands blocks over after a membership change (the receiver checks ownership)
TIERS = 2            # flags: this PROBE asks for each key's tier (a router's prefix score), and its reply gives them
CLAIM = 4            # flags: this PROBE claims the keys the member misses for a scheduler, and its reply gives states
_KNOWN_FLAGS = HANDOFF | TIERS | CLAIM
_MAX_CLAIM_STATE = 2  # claimed, held, pending (kvstore/engine/claims.py)
_MAX_TIER = 2        # a probe answers a node's own tiers: none, RAM, disk
HEADER = struct.Struct("<4sBBHQIIQ")
MAX_META_BYTES = 1 << 20


class FrameError(Exception):
    """A frame that breaks the format or a limit; the connection it came on is closed."""


@dataclass(frozen=True)
class Header:
    op: int
    request_id: int
    count: int
    meta_len: int
    payload_len: int
    flags: int = 0

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, self.op, self.flags, self.request_id, self.count, self.meta_len,
                           self.payload_len)


@dataclass(frozen=True)
class NamespaceDesc:
    """What a receiver needs to register a namespace it has not seen (pushes carry it)."""

    name: str
    model: str = ""
    layout_digest: str = ""
    tenant: str = ""
    tokens_per_block: int = 0


def check_header(raw: bytes, *, max_keys: int, max_block_bytes: int, expect: tuple[int, ...] = _OPS) -> Header:
    if len(raw) != HEADER.size:
        raise FrameError(f"truncated header: {len(raw)} of {HEADER.size} bytes")
    magic, version, op, flags, rid, count, meta_len, payload = HEADER.unpack(raw)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}")
    if version != VERSION:
        raise FrameError(f"unsupported version {version}")
    if op not in expect:
        raise FrameError(f"unexpected op {op}")
    if flags & ~_KNOWN_FLAGS:
        raise FrameError(f"unknown flags {flags:#x}")
    if flags & HANDOFF and op != PUSH:
        raise FrameError(f"the hand-off flag on op {op} (only a push hands blocks over)")
    if flags & TIERS and op not in (PROBE, PROBE_REPLY):
        raise FrameError(f"the tiers flag on op {op} (only a probe and its reply carry tiers)")
    if flags & CLAIM and (op not in (PROBE, PROBE_REPLY) or flags & TIERS):
        raise FrameError(f"the claim flag on op {op}{' with tiers' if flags & TIERS else ''} (only a probe and its "
                         f"reply carry claims, without tiers)")
    if count > max_keys:
        raise FrameError(f"{count} keys in one frame (max {max_keys})")
    if meta_len > MAX_META_BYTES:
        raise FrameError(f"metadata of {meta_len} bytes (max {MAX_META_BYTES})")
    if payload > count * max_block_bytes:
        raise FrameError(f"payload of {payload} bytes for {count} blocks of at most {max_block_bytes}")
    return Header(op, rid, count, meta_len, payload, flags)


class _Reader:
    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise FrameError("metadata shorter than its fields")
        out = self.buf[self.pos: self.pos + n]
        self.pos += n
        return out

    def string(self) -> str:
        (n,) = struct.unpack("<H", self.take(2))
        try:
            return self.take(n).decode()
        except UnicodeDecodeError as exc:
            raise FrameError("a string field is not UTF-8") from exc

    def keys(self, count: int) -> list[bytes]:
        """`count` length-prefixed keys. Keys of one length (the usual batch) are cut by slicing once their
        length bytes are checked in one C-level comparison; any other batch takes the per-key loop."""
        buf, pos = self.buf, self.pos
        if count and pos < len(buf) and buf[pos]:
            step = buf[pos] + 1
            end = pos + count * step
            if end <= len(buf) and buf[pos:end:step] == bytes((step - 1,)) * count:
                self.pos = end
                return [buf[i + 1: i + step] for i in range(pos, end, step)]
        out = []
        for _ in range(count):
            n = self.take(1)[0]
            if n == 0:
                raise FrameError("empty key")
            out.append(self.take(n))
        return out

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def done(self) -> None:
        if self.pos != len(self.buf):
            raise FrameError(f"{len(self.buf) - self.pos} unexpected bytes after the metadata")


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<H", len(b)) + b


def _keys(keys: list[bytes]) -> bytes:
    """Each key after its length byte; a batch of one key length (the usual) is joined in one C-level call."""
    lengths = set(map(len, keys))
    if len(lengths) == 1:
        (n,) = lengths
        if 0 < n < 256:
            sep = bytes((n,))
            return sep + sep.join(keys)
    return b"".join(bytes([len(k)]) + k for k in keys)


def encode_fetch(namespace: str, keys: list[bytes]) -> bytes:
    return _string(namespace) + _keys(keys)


def decode_fetch(meta: bytes, count: int) -> tuple[str, list[bytes]]:
    r = _Reader(meta)
    ns, keys = r.string(), r.keys(count)
    r.done()
    return ns, keys


def encode_presence(present: list[bool]) -> bytes:
    return bytes(1 if p else 0 for p in present)


def decode_presence(meta: bytes, count: int) -> list[bool]:
    if len(meta) != count:
        raise FrameError(f"presence table of {len(meta)} bytes for {count} keys")
    if any(b > 1 for b in meta):
        raise FrameError("a presence byte other than 0 or 1")
    return [b == 1 for b in meta]


def encode_tiers(tiers: list[int]) -> bytes:
    return bytes(tiers)


def _byte_table(meta: bytes, count: int, top: int, what: str, values: str) -> list[int]:
    """One byte per key, each at most `top` (a tier table, a claim state table)."""
    if len(meta) != count:
        raise FrameError(f"{what} table of {len(meta)} bytes for {count} keys")
    if any(b > top for b in meta):
        raise FrameError(f"a {what} byte above {top} ({values})")
    return list(meta)


def decode_tiers(meta: bytes, count: int) -> list[int]:
    return _byte_table(meta, count, _MAX_TIER, "tier", "none, RAM, disk")


def encode_claim(namespace: str, keys: list[bytes], claimant: bytes, ttl_ms: int) -> bytes:
    return encode_fetch(namespace, keys) + bytes([len(claimant)]) + claimant + struct.pack("<I", ttl_ms)


def decode_claim(meta: bytes, count: int) -> tuple[str, list[bytes], bytes, int]:
    """(namespace, keys, claimant, ttl_ms); the claimant's and ttl's bounds are the engine's (claims.check_claim)."""
    r = _Reader(meta)
    ns, keys = r.string(), r.keys(count)
    claimant = r.take(r.take(1)[0])
    ttl_ms = r.u32()
    r.done()
    return ns, keys, claimant, ttl_ms


def decode_claim_states(meta: bytes, count: int) -> list[int]:
    return _byte_table(meta, count, _MAX_CLAIM_STATE, "claim state", "claimed, held, pending")


def encode_sizes(sizes: np.ndarray, checksums: np.ndarray) -> bytes:
    pairs = np.empty((len(sizes), 2), dtype="<u8")
    pairs[:, 0], pairs[:, 1] = sizes, checksums
    return pairs.tobytes()


def decode_sizes(meta: bytes, count: int, payload_len: int, max_block_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(sizes, checksums) of a reply or push; sizes must add up to the payload and respect the block limit."""
    if len(meta) != 16 * count:
        raise FrameError(f"size table of {len(meta)} bytes for {count} keys")
    pairs = np.frombuffer(meta, dtype="<u8").reshape(count, 2) if count else np.zeros((0, 2), dtype="<u8")
    sizes, checksums = pairs[:, 0].astype(np.int64), pairs[:, 1].copy()
    if count and (int(pairs[:, 0].max()) > max_block_bytes):
        raise FrameError(f"a block of {int(pairs[:, 0].max())} bytes (max {max_block_bytes})")
    if int(sizes.sum()) != payload_len:
        raise FrameError(f"block sizes add up to {int(sizes.sum())}, the header says {payload_len}")
    return sizes, checksums


def encode_push(desc: NamespaceDesc, keys: list[bytes], sizes: np.ndarray, checksums: np.ndarray) -> bytes:
    return (_string(desc.name) + _string(desc.model) + _string(desc.layout_digest) + _string(desc.tenant)
            + struct.pack("<I", desc.tokens_per_block) + _keys(keys) + encode_sizes(sizes, checksums))


def decode_push(meta: bytes, count: int, payload_len: int,
                max_block_bytes: int) -> tuple[NamespaceDesc, list[bytes], np.ndarray, np.ndarray]:
    r = _Reader(meta)
    desc = NamespaceDesc(r.string(), r.string(), r.string(), r.string(), r.u32())
    keys = r.keys(count)
    sizes, checksums = decode_sizes(meta[r.pos:], count, payload_len, max_block_bytes)
    return desc, keys, sizes, checksums
