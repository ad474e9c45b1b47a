"""Our keys of prefixes vLLM has already hashed, found by vLLM's block hash: a new turn hashes only its new tokens.

Why: every turn of an agent session is a new request whose prompt repeats the session so far (~142K tokens,
>96 % seen before), and our keys are a chain over the token ids (keys.py), so a new request's keys were hashed
from its first token in vLLM's scheduler step: a 142K-token prompt's 2,218 keys of 64 tokens cost ~4 ms there.
vLLM has hashed the same prompt already, block by block, for its own prefix cache (Request.block_hashes), each
hash naming the whole prefix up to the end of its block. This memo maps such a hash to our key of the same
prefix, so the scheduler side takes the keys of the part it has seen (a dict lookup per key) and chains on from
there (SchedulerSide._extend).

Why it cannot hand out a wrong key:
- our chunk i is found by vLLM's hash of the last vLLM block of the chunk. That hash names a prefix holding chunk
  i's whole prefix only where vLLM hashes in blocks at least as large as its KV blocks: one KV cache group (hash
  block = block_size x DCP; with EAGLE each hash also covers a few tokens more, a longer prefix still). With
  several groups vLLM hashes at a finer grain (their GCD), and the composition root leaves the memo out
  (kvstore_connector/vllm_connector.py), as it does for a hash function narrower than 128 bits;
- an entry keeps the chain root it was made under (seed, LoRA adapter): a hash found under another root is a
  miss. Requests with multimodal inputs (their root names every image) or prompt embeddings are not memoized;
- equal hashes, equal prefixes, equal keys: the chain from there on is the same one (test: keys through the memo
  equal keys from scratch, byte for byte, turn after turn of a real vLLM scheduler's requests).
Bounded: at most `capacity` entries (~230 bytes each), the oldest eighth dropped when full.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

__all__ = ["KeyMemo", "DEFAULT_CAPACITY"]

DEFAULT_CAPACITY = 1 << 18  # keys: 256K x 64 tokens = 16.8M tokens of sessions, ~60 MB at most


class KeyMemo:
    """vLLM block hash -> (chain root, our key of the prefix ending with that block). One scheduler thread."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 8:
            raise ValueError(f"a key memo holds at least 8 keys, got {capacity}")
        self.capacity = capacity
        self._map: dict[Any, tuple[bytes, bytes]] = {}

    def __len__(self) -> int:
        return len(self._map)

    def known(self, root: bytes, hashes: Sequence[Any], blocks_per_key: int, limit: int) -> list[bytes]:
        """Our keys of the leading chunks (at most `limit`) whose prefix vLLM hashed and this memo holds under
        `root`, in order, up to the first it does not."""
        out: list[bytes] = []
        get = self._map.get
        for h in itertools.islice(hashes, blocks_per_key - 1, None, blocks_per_key):  # each chunk's last block
            if len(out) >= limit:
                break
            hit = get(h)
            if hit is None or hit[0] != root:
                break
            out.append(hit[1])
        return out

    def remember(self, root: bytes, hashes: Sequence[Any], blocks_per_key: int, keys: Sequence[bytes],
                 start: int) -> None:
        """keys[start:] (a chain under `root`), each by vLLM's hash of its chunk's last block, where vLLM has
        hashed that block."""
        m = self._map
        for i in range(start, min(len(keys), len(hashes) // blocks_per_key)):
            m[hashes[(i + 1) * blocks_per_key - 1]] = (root, keys[i])
        if len(m) > self.capacity:
            for h in list(itertools.islice(m, len(m) - self.capacity + self.capacity // 8)):
                del m[h]
