"""KV cache groups: which stored blocks a prefix hit needs, group by group (vLLM's hybrid KV cache manager).

A model whose layers attend differently (Gemma 2/3 and gpt-oss: sliding-window and full layers; Llama 4:
chunked local and full) has one KV cache group per kind of layer, each with its own block table. With the
hybrid manager (HMA) on, vLLM keeps for a sliding-window group only the blocks the next token can attend to
and hands the others back (the group's block table then holds the null block, id 0, in their place). The
connector follows the same rule:

- every group stores its blocks under its own namespace (its index, kind and layer count are in the digest),
  with the same chained keys (a key still names the whole prefix up to its end);
- a prefix of ``p`` tokens is a hit only when every full-attention group holds all its keys and every windowed
  group holds the keys of the blocks vLLM keeps at ``p`` (`GroupKind.first_needed_block`);
- a windowed group saves only the keys a later hit can use (`saved_in_window`): the window before the end of
  the prompt (where the next turn of a conversation hits), and before every ``checkpoint`` tokens (where a
  forked sub-agent that shares a long prefix can hit). The rest of a long prompt's sliding-window KV is never
  read again, so storing it would only evict something useful.

Nothing here imports vLLM: `groups_from_config` reads vLLM's KVCacheConfig by attribute and class name, so the
scheduler logic is tested without it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.errors import ConfigError

__all__ = ["GroupKind", "KVGroup", "FULL", "NULL_BLOCK", "first_needed_key", "groups_from_config", "save_points",
           "saved_in_window", "window_hit"]

NULL_BLOCK = 0  # vLLM's null block: what a windowed group's block table holds for blocks it has handed back


@dataclass(frozen=True)
class GroupKind:
    """How a group's layers attend: "full", "sliding" (``window`` tokens, vLLM's sliding_window, plus
    ``retained`` extra trailing tokens vLLM keeps for speculative decoding) or "chunked" (local attention
    inside chunks of ``window`` tokens)."""

    name: str = "full"
    window: int = 0
    retained: int = 0

    def __post_init__(self) -> None:
        if self.name not in ("full", "sliding", "chunked"):
            raise ValueError(f"unknown KV cache group kind {self.name!r}")
        if self.name != "full" and self.window < 1:
            raise ValueError(f"a {self.name} group needs a window >= 1, got {self.window}")

    @property
    def windowed(self) -> bool:
        return self.name != "full"

    def skipped_tokens(self, computed: int) -> int:
        """Leading tokens the token after ``computed`` ones cannot attend to (vLLM's get_num_skipped_tokens)."""
        if self.name == "sliding":
            return max(0, computed - self.window + 1 - self.retained)
        if self.name == "chunked":
            return computed // self.window * self.window
        return 0

    def first_needed_block(self, computed: int, block_size: int) -> int:
        """The first vLLM block a request resumed after ``computed`` tokens holds (earlier ones are null)."""
        return self.skipped_tokens(computed) // block_size

    def describe(self) -> str:
        if self.name == "full":
            return "full"
        return f"{self.name}={self.window}" + (f"+{self.retained}" if self.retained else "")


FULL = GroupKind()


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group of this process's config: its index in vLLM's block tables, kind, layers, and the bytes
    of one vLLM block of all its layers (vLLM's page size per layer times the layers, this worker's heads)."""

    index: int
    kind: GroupKind
    layer_names: tuple[str, ...]
    block_size: int
    block_bytes: int
    tp_shards: int | None = None  # distinct TP shards of its cache (vLLM's max_tp_shards; MLA: 1, every rank a
    #                               replica); None: one per rank

    def tp_shard(self, tp_rank: int, tp_size: int) -> tuple[int, int]:
        """(this rank's shard, shards): ranks beyond ``tp_shards`` hold replicas of the same bytes, which are
        stored once, under the shard's name, and every replica loads them."""
        n = min(tp_size, self.tp_shards or tp_size)
        return tp_rank * n // tp_size, n

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)


def _kind_of(spec: Any) -> GroupKind:
    """The kind of one vLLM KVCacheSpec, by class name (SlidingWindowMLASpec is a sliding one). A FullAttentionSpec
    that carries a sliding_window is what vLLM builds with the hybrid manager off: every block is kept, so full."""
    names = [c.__name__ for c in type(spec).__mro__]
    if "SlidingWindowSpec" in names:
        return GroupKind("sliding", int(spec.sliding_window), int(getattr(spec, "extra_retained_tokens", 0) or 0))
    if "ChunkedLocalAttentionSpec" in names:
        return GroupKind("chunked", int(spec.attention_chunk_size))
    if "FullAttentionSpec" in names:
        return FULL
    raise ConfigError(f"KVStoreConnector cannot store a KV cache group of type {type(spec).__name__} (it stores "
                      "attention KV: full, MLA, sliding-window and chunked local attention); serve this model "
                      "without --kv-transfer-config, or with a connector for its state")


def groups_from_config(kv_cache_config: Any, fallback_layers: Iterable[str] = ()) -> list[KVGroup]:
    """The groups of vLLM's KVCacheConfig (None: one full group over ``fallback_layers``, block size unknown)."""
    if kv_cache_config is None or not getattr(kv_cache_config, "kv_cache_groups", None):
        return [KVGroup(0, FULL, tuple(fallback_layers), 0, 0)]
    out = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: one spec per layer
        first = next(iter(per_layer.values())) if per_layer else spec
        kind = _kind_of(first)
        names = tuple(g.layer_names)
        page = int(spec.page_size_bytes) if per_layer else int(spec.page_size_bytes) * len(names)
        shards = getattr(first, "max_tp_shards", None)
        out.append(KVGroup(i, kind, names, int(first.block_size), page, int(shards) if shards else None))
    sizes = {g.block_size for g in out}
    if len(sizes) != 1:
        raise ConfigError(f"KVStoreConnector needs one block size across KV cache groups, got {sorted(sizes)}")
    return out


def saved_in_window(kind: GroupKind, key: int, *, tokens_per_key: int, block_size: int,
                    save_points: Sequence[int]) -> bool:
    """Whether a windowed group stores stored-block ``key``: some save point ``p`` (a prefix length, in tokens,
    where a later request may hit) lies after the key's start and keeps one of its blocks."""
    start, end = key * tokens_per_key, (key + 1) * tokens_per_key
    return any(start < p and end > kind.first_needed_block(p, block_size) * block_size for p in save_points)


def save_points(prompt_len: int, tokens_per_key: int, checkpoint: int) -> list[int]:
    """Where later requests hit a prompt of ``prompt_len`` tokens: its last stored-block boundary (the next turn
    of the conversation), the one before the last prompt token (the same prompt again: vLLM computes the last
    token itself), and every ``checkpoint`` tokens, rounded down to a stored block (forks sharing a prefix)."""
    t = tokens_per_key
    points = {prompt_len // t * t, max(0, prompt_len - 1) // t * t}
    if checkpoint > 0:
        points.update(c // t * t for c in range(checkpoint, prompt_len + 1, checkpoint))
    return sorted(p for p in points if p > 0)


def first_needed_key(kind: GroupKind, keys: int, *, tokens_per_key: int, block_size: int) -> int:
    """The first stored block a hit of ``keys`` stored blocks needs from a group of this kind."""
    blocks_per_key = tokens_per_key // block_size
    return kind.first_needed_block(keys * tokens_per_key, block_size) // blocks_per_key


def window_hit(limit: int, shards: Sequence[tuple[GroupKind, Sequence[bool]]], *, tokens_per_key: int,
               block_size: int) -> int:
    """The longest hit of at most ``limit`` stored blocks for which every windowed shard holds the keys it needs;
    ``shards``: (kind, presence of keys 0 .. limit-1). The full-attention shards' common prefix is ``limit``."""
    import numpy as np  # noqa: PLC0415 - only the scheduler's lookup needs it

    held = [(kind, np.concatenate([[0], np.cumsum(np.asarray(p[:limit], dtype=np.int64))])) for kind, p in shards]
    for n in range(limit, 0, -1):
        if all(int(c[n] - c[lo]) == n - lo for kind, c in held
               for lo in [first_needed_key(kind, n, tokens_per_key=tokens_per_key, block_size=block_size)]):
            return n
    return 0
