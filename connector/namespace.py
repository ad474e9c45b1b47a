"""Namespaces: blocks are only exchanged between identical KV layouts.

namespace = model id + a digest of the KV layout (dtype, block size, layers, KV heads, head dim, TP rank and
size, stored-block size) + the request's cache_salt. Two models, two TP layouts or two salts never share a
block: a hit across them would hand a model someone else's KV and produce garbage, silently.
The scheduler (which looks up) and the worker (which stores and loads) build the same `KVLayoutSpec` from
the vLLM config, so they agree on the name without talking to each other.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass

__all__ = ["KVLayoutSpec", "namespace_for", "registration"]

_BAD = re.compile(r"[^A-Za-z0-9._:@+=-]+")


@dataclass(frozen=True)
class KVLayoutSpec:
    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int
    tp_size: int
    blocks_per_key: int

    @property
    def bytes_per_token(self) -> int:
        """K and V for every layer, this rank's heads (standard attention; the worker checks the real size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * _dtype_bytes(self.dtype)

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def tokens_per_key(self) -> int:
        return self.block_size * self.blocks_per_key

    def digest(self) -> str:
        """Covers the full model string too: two fine-tunes named .../llama in different orgs must not mix."""
        body = asdict(self)
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def _dtype_bytes(dtype: str) -> int:
    name = dtype.removeprefix("torch.")
    for prefix, n in (("float8", 1), ("fp8", 1), ("uint8", 1), ("int8", 1), ("bfloat16", 2), ("float16", 2),
                      ("half", 2), ("float32", 4), ("float", 4), ("float64", 8)):
        if name.startswith(prefix):
            return n
    raise ValueError(f"unknown KV cache dtype {dtype!r}")


def namespace_for(spec: KVLayoutSpec, cache_salt: str | None = None) -> str:
    """A valid kvstore namespace name (<= 200 chars of [A-Za-z0-9._:/@+=-])."""
    model = _BAD.sub("-", spec.model.strip("/").split("/")[-1] if "/" in spec.model else spec.model)[:80] or "model"
    name = f"vllm/{model}/{spec.digest()}"
    if cache_salt:
        name += "/salt=" + hashlib.sha256(cache_salt.encode()).hexdigest()[:16]
    return name


def registration(spec: KVLayoutSpec) -> dict[str, object]:
    """RegisterNamespace arguments for every namespace of this layout: the daemon shows them in `kvstore ls`
    and, knowing tokens per stored block, reports lookups and hits in tokens."""
    return {"model": spec.model, "layout_digest": spec.digest(), "tokens_per_block": spec.tokens_per_key}
