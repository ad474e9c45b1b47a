"""Stable block keys: a chained 128-bit hash over token ids, the same in every process and after restarts.

vLLM's own block hashes start from a per-process random NONE_HASH (unless PYTHONHASHSEED is set), so keys
built on them never hit across restarts or across two vLLM instances. Ours are deterministic:

    root  = xxh3_128(b"kvstore/v1" + extra, seed)      extra = LoRA name and multimodal hashes
    key_i = xxh3_128(key_{i-1} + int64 tokens of chunk i, seed)

A key therefore names the whole prefix up to the end of its chunk, which is what makes a prefix Lookup
meaningful. A partial last chunk (a request's tail, kvstore_connector/tails.py) has a key of its own:

    tail  = xxh3_128(NUL + b"tail" + key_{i-1} + int64 tokens of the tail, seed)

(5 + 16 + 8t bytes hashed, never the 16 + 8T of a full chunk's key, so the two kinds cannot meet).

Multimodal hashes go into the root (not into the chunk that holds the image): conservative —
a different image changes every key of the request, including ones before it — but never wrong.
The cache_salt is not hashed here: it selects the namespace (see kvstore_connector/namespace.py).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import xxhash

__all__ = ["KeyChain", "chain_root", "tail_keys"]

_DOMAIN = b"kvstore/v1"


def chain_root(seed: int, *, lora_name: str | None = None, mm_hashes: Sequence[str] = ()) -> bytes:
    """The chain's starting value for one request's extra inputs."""
    parts = [_DOMAIN]
    if lora_name:
        parts.append(b"\x00lora:" + lora_name.encode())
    for h in mm_hashes:
        parts.append(b"\x00mm:" + str(h).encode())
    return xxhash.xxh3_128_digest(b"".join(parts), seed=seed)


class KeyChain:
    """Keys of the full chunks of one growing token sequence, computed once each (the prompt grows by turns
    and by generated tokens; hashing the whole prefix again every scheduler step would be quadratic)."""

    def __init__(self, tokens_per_key: int, seed: int, root: bytes) -> None:
        if tokens_per_key < 1:
            raise ValueError(f"tokens_per_key must be >= 1, got {tokens_per_key}")
        self.tokens_per_key = tokens_per_key
        self.seed = seed
        self._prev = root
        self.keys: list[bytes] = []

    def adopt(self, keys: Sequence[bytes]) -> None:
        """Start from the keys of the first len(keys) chunks, known already (kvstore_connector/key_memo.py): extend then
        hashes only the chunks after them. Only on a chain with no keys yet."""
        if self.keys:
            raise ValueError(f"adopt on a chain that holds {len(self.keys)} keys already")
        if keys:
            self.keys = list(keys)
            self._prev = self.keys[-1]

    def extend(self, token_ids: Sequence[int]) -> list[bytes]:
        """Hash every full chunk of ``token_ids`` not hashed yet; returns all keys so far.

        ``token_ids`` must extend the sequence seen before (the same request's tokens): the chain does not
        re-check earlier chunks.
        """
        t = self.tokens_per_key
        full = len(token_ids) // t
        done = len(self.keys)
        if full > done:
            buf = _int64_bytes(token_ids[done * t: full * t])
            prev, seed, digest, keys, step = self._prev, self.seed, xxhash.xxh3_128_digest, self.keys, 8 * t
            for off in range(0, len(buf), step):
                prev = digest(prev + buf[off:off + step], seed=seed)
                keys.append(prev)
            self._prev = prev
        return self.keys


def tail_keys(parent: bytes, tokens: Sequence[int], seed: int) -> list[bytes]:
    """The tail keys of every prefix of ``tokens`` after the chain key ``parent`` (the root for a tail in the
    first chunk): element t-1 names the first t tokens. One streaming hash, a digest per token: a lookup asks
    for every length at once, since it cannot know where the last request's context ended."""
    h = xxhash.xxh3_128(seed=seed)
    h.update(_TAIL + parent)
    buf = _int64_bytes(tokens)
    out = []
    for off in range(0, len(buf), 8):
        h.update(buf[off:off + 8])
        out.append(h.digest())
    return out


_TAIL = b"\x00tail"


def _int64_bytes(tokens: Sequence[int]) -> bytes:
    """Little-endian int64 bytes of token ids. Why not np.asarray: a new agent turn is a new request whose
    whole prompt (~142K tokens) is hashed in vLLM's scheduler step; from a Python list, asarray took 6.3 ms of
    that, struct.pack 3.0 (np.fromiter 4.8)."""
    if isinstance(tokens, np.ndarray):
        return tokens.astype("<i8", copy=False).tobytes()
    return struct.pack(f"<{len(tokens)}q", *tokens)
