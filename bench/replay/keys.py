"""Stable block keys for trace blocks, and the few content bytes that let a replay check what it loaded.

key_i = sha256(key_{i-1} || uint64_le(hash_id_i)), key_{-1} = sha256(SEED_TEXT): a chain, like vLLM's block
hashes, so a key names the whole prefix up to its block, never just the block's own id. Fixed seed and no
Python `hash()`, so the same trace gives the same keys in every process and run (DESIGN principle 6) and the
simulator and the replayer agree on identity by construction. sha256 is already 32 bytes, the key length.

Content: each stored block starts with its key and ends with the key's first 8 bytes. A load that checks both
ends catches a wrong slot, a torn copy and an offset error, at the cost of 40 compared bytes a block.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

__all__ = ["SEED", "KEY_BYTES", "chain_keys", "stamp", "verify"]

SEED_TEXT = b"kvstore.bench.replay/v1"
SEED = hashlib.sha256(SEED_TEXT).digest()
KEY_BYTES = 32
_TAIL = 8
_U64 = struct.Struct("<Q")


def chain_keys(hash_ids: Sequence[int]) -> list[bytes]:
    """One 32-byte key per block id, chained from SEED."""
    out: list[bytes] = []
    prev = SEED
    sha, pack = hashlib.sha256, _U64.pack
    for h in hash_ids:
        prev = sha(prev + pack(h)).digest()
        out.append(prev)
    return out


def stamp(rows: np.ndarray, keys: Sequence[bytes]) -> None:
    """Write each key's marks into the matching row of a (n_blocks, block_bytes) uint8 array, vectorised."""
    n = len(keys)
    if n:
        k = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(n, KEY_BYTES)
        rows[:n, :KEY_BYTES] = k
        rows[:n, -_TAIL:] = k[:, :_TAIL]


def verify(rows: np.ndarray, keys: Sequence[bytes]) -> int:
    """How many leading rows carry their key's marks (a load stops trusting the chain at the first bad one)."""
    n = len(keys)
    if not n:
        return 0
    k = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(n, KEY_BYTES)
    ok = (rows[:n, :KEY_BYTES] == k).all(axis=1) & (rows[:n, -_TAIL:] == k[:, :_TAIL]).all(axis=1)
    return n if ok.all() else int(np.argmin(ok))
