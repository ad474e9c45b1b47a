"""Block contents derived from their keys, so any wrong byte served anywhere is detected by the reader alone.

A block's size and bytes come from a PRNG seeded with xxh3(key): a block served under another key, a shifted
copy, a torn write or a stale slot all differ from `expected(key)` somewhere (a repeated pattern would hide
shifts by its period; random bytes do not).
"""

from __future__ import annotations

import numpy as np
import xxhash

__all__ = ["NS", "FILL_NS", "SOAK_TENANT", "FILL_TENANT", "FUZZ_NAMESPACES", "soak_key", "fill_key", "expected", "wrong_bytes", "is_soak_key"]

NS = "soak/kv"             # the workers' namespace
FILL_NS = "soak/fill"      # the disk-fill bursts
SOAK_TENANT = "soak"       # owns NS; has a disk quota (tenant_disk_quota), so fill bursts cannot evict it below
FILL_TENANT = "fill"       # owns FILL_NS; no quota
FUZZ_NAMESPACES = ["soak/fuzz-a", "soak/fuzz-b"]  # the fuzzer's playground: never verified, never shared
MIN_BYTES, MAX_BYTES = 1024, 64 * 1024


def soak_key(i: int) -> bytes:
    return b"s%07d" % i


def fill_key(i: int) -> bytes:
    return b"f%07d" % i


def is_soak_key(key: bytes) -> bool:
    return len(key) == 8 and key[:1] in (b"s", b"f") and key[1:].isdigit()


def expected(key: bytes) -> bytes:
    seed = xxhash.xxh3_64_intdigest(key)
    size = MIN_BYTES + seed % (MAX_BYTES - MIN_BYTES + 1)
    return np.random.default_rng(seed).bytes(size)


def wrong_bytes(key: bytes, got: bytes | bytearray | memoryview) -> int:
    """0 when `got` is exactly the block of `key`; else how many bytes are wrong (length mismatch: all)."""
    want = expected(key)
    if len(got) != len(want):
        return max(len(got), len(want))
    a = np.frombuffer(want, dtype=np.uint8)
    b = np.frombuffer(bytes(got), dtype=np.uint8)
    return int(np.count_nonzero(a != b))
