"""Where one vLLM block's bytes live in the paged KV cache: a list of contiguous pieces per block.

vLLM gives the worker one tensor per attention layer. Backends differ in where the block dimension is:
FlashAttention and the CPU backends use ``(2, num_blocks, ...)`` (K and V are two pieces per layer),
FlashInfer-style ``(num_blocks, 2, ...)`` (one piece per layer), a cross-layer layout
``(num_blocks, layers, ...)`` (one piece per block for the whole model). Rather than special-case each,
`KVLayout` finds the block dimension (the one of size ``num_blocks``), treats every index of the dimensions
before it as a separate piece, and requires the dimensions after it to fill one dense byte range, so the piece
of block ``b`` is the byte range ``[base + b * block_stride, + piece_bytes)``. The dimensions after it may be a
permutation of a dense block (vLLM 0.33's default GPU layout gives per-layer views (blocks, K/V, tokens, heads x
dim) of pages stored token-major): the piece is then the page's bytes in memory order, which is why the
namespace names vLLM's KV cache layout (kvstore_connector/namespace.py).

A stored block (one key) holds ``blocks_per_key`` consecutive vLLM blocks, each laid out as all its pieces in
order. `plan` turns a batch of (slot address, vLLM block ids) into flat (dst, src, length) arrays for the native
batched copy, merging pieces that are adjacent on both sides, with no Python loop over blocks or layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvstore._native import plan_pieces

__all__ = ["KVLayout", "CopyPlan", "LayoutError"]

U64 = npt.NDArray[np.uint64]


class LayoutError(ValueError):
    """The registered KV caches cannot be described as per-block contiguous pieces."""


@dataclass(frozen=True)
class CopyPlan:
    """Flat arguments of one batched copy: copy lengths[i] bytes from src[i] to dst[i]."""

    dst: U64
    src: U64
    lengths: U64

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())


def _dense_elements(shape: tuple[int, ...], stride: tuple[int, ...]) -> int | None:
    """Elements of the dense range that dims (sizes, strides) fill exactly, in some order; None if they leave
    gaps or overlap."""
    expect = 1
    for n, s in sorted(((n, s) for n, s in zip(shape, stride) if n != 1), key=lambda p: p[1]):
        if s != expect:
            return None
        expect *= n
    return expect


def _pieces_of(name: str, t: Any, num_blocks: int) -> tuple[list[int], int, int]:
    """(piece base addresses, block stride in bytes, piece bytes) of one layer tensor."""
    shape, stride, esize = tuple(t.shape), tuple(t.stride()), t.element_size()
    if len(shape) > 1 and shape[1] == num_blocks:
        d = 1  # (2, num_blocks, ...): K/V first, the common layout (also wins when num_blocks == 2)
    elif shape and shape[0] == num_blocks:
        d = 0  # (num_blocks, ...): K/V or layers inside the block
    elif num_blocks in shape:
        d = shape.index(num_blocks)
    else:
        raise LayoutError(f"layer {name}: no dimension of size num_blocks={num_blocks} in shape {shape}")
    expect = _dense_elements(shape[d + 1:], stride[d + 1:])
    if expect is None:
        raise LayoutError(f"layer {name}: shape {shape} stride {stride}: the dims after the block dim are not "
                          "contiguous (nor a permutation of contiguous dims); ask vLLM for a contiguous KV cache "
                          "layout")
    piece_bytes = expect * esize
    block_stride = stride[d] * esize
    if block_stride < piece_bytes:
        raise LayoutError(f"layer {name}: blocks overlap (stride {stride[d]} < {expect} elements)")
    outer = np.zeros(1, dtype=np.int64)
    for n, s in zip(shape[:d], stride[:d]):
        outer = (outer[:, None] + np.arange(n, dtype=np.int64)[None, :] * s).reshape(-1)
    base = t.data_ptr()
    return [base + int(o) * esize for o in outer], block_stride, piece_bytes


class KVLayout:
    """Per-block pieces of all registered layers (deduplicated: layers sharing one KV tensor count once)."""

    def __init__(self, kv_caches: Mapping[str, Any], num_blocks: int) -> None:
        if not kv_caches:
            raise LayoutError("no KV cache tensors were registered")
        if num_blocks < 1:
            raise LayoutError(f"num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.layer_names = list(kv_caches)
        seen: set[tuple[int, tuple[int, ...]]] = set()
        bases: list[int] = []
        strides: list[int] = []
        lens: list[int] = []
        devices = set()
        dtypes = set()
        self.tensors = []
        for name, t in kv_caches.items():
            ident = (t.data_ptr(), tuple(t.shape))
            if ident in seen:
                continue
            seen.add(ident)
            self.tensors.append(t)  # keep alive: we hold raw addresses
            devices.add(str(t.device))
            dtypes.add(str(t.dtype))
            b, s, n = _pieces_of(name, t, num_blocks)
            bases += b
            strides += [s] * len(b)
            lens += [n] * len(b)
        if len(devices) != 1:
            raise LayoutError(f"KV caches live on several devices {sorted(devices)}: one worker, one device")
        self.device = devices.pop()
        self.dtype = dtypes.pop() if len(dtypes) == 1 else "mixed"
        self.piece_base = np.asarray(bases, dtype=np.uint64)
        self.piece_stride = np.asarray(strides, dtype=np.uint64)
        self.piece_bytes = np.asarray(lens, dtype=np.uint64)
        self.piece_offset = np.concatenate([[0], np.cumsum(self.piece_bytes)[:-1]]).astype(np.uint64)
        self.block_bytes = int(self.piece_bytes.sum())
        self._pieces = (self.piece_base, self.piece_stride, self.piece_offset, self.piece_bytes)
        self.address_range = self._range()
        # Can a plan's pieces join into longer ranges? Within a block, where one piece ends where the next
        # begins in the cache for every block (a cross-layer layout); a single piece a block joins across
        # consecutive blocks. Otherwise (per-layer tensors) only by an accident of addresses, and the plan
        # skips the search: ~10 numpy passes over every piece, half of a plan's time (32 keys x 64 pieces)
        joins = (self.piece_base[1:] == self.piece_base[:-1] + self.piece_bytes[:-1]) & (
            self.piece_stride[1:] == self.piece_stride[:-1])
        self._may_join = self.num_pieces == 1 or bool(joins.any())

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def num_pieces(self) -> int:
        return len(self.piece_base)

    def _range(self) -> tuple[int, int]:
        lo = int(self.piece_base.min())
        hi = int((self.piece_base + self.piece_stride * np.uint64(self.num_blocks - 1) + self.piece_bytes).max())
        return lo, hi

    def plan(self, slot_addrs: npt.ArrayLike, block_ids: npt.ArrayLike, *, to_store: bool) -> CopyPlan:
        """Copy plan for ``slot_addrs[k]`` <-> vLLM blocks ``block_ids[k, :]`` (k keys x blocks_per_key).

        A block id of -1 leaves that part of the slot and of the cache untouched.

        to_store=True gathers cache -> slots (a save); False scatters slots -> cache (a load).
        """
        slots = np.ascontiguousarray(slot_addrs, dtype=np.uint64).reshape(-1)
        blocks = np.ascontiguousarray(block_ids, dtype=np.int64)
        if blocks.ndim != 2 or blocks.shape[0] != len(slots):
            raise LayoutError(f"block_ids must be (keys, blocks_per_key); got {blocks.shape} for {len(slots)} slots")
        cap = blocks.size * self.num_pieces
        if not cap:
            return CopyPlan(*(np.empty(0, np.uint64) for _ in range(3)))
        dst, src, lengths = np.empty(cap, np.uint64), np.empty(cap, np.uint64), np.empty(cap, np.uint64)
        try:  # one pass in C (kvstore/_native/plan.c says why not numpy), every block id checked first
            n = plan_pieces(slots, blocks.reshape(-1), blocks.shape[1], self._pieces, self.block_bytes,
                            self.num_blocks, to_store, (dst, src, lengths))
        except ValueError as exc:
            raise LayoutError(str(exc)) from None
        if self._may_join:
            return _coalesce(dst[:n], src[:n], lengths[:n])
        return CopyPlan(dst[:n], src[:n], lengths[:n])


def _coalesce(dst: U64, src: U64, lengths: U64) -> CopyPlan:
    """Merge runs where piece i+1 starts right after piece i on both sides (cross-layer layouts: one copy)."""
    if len(lengths) <= 1:
        return CopyPlan(dst.copy(), src.copy(), lengths.copy())
    cont = (src[1:] == src[:-1] + lengths[:-1]) & (dst[1:] == dst[:-1] + lengths[:-1])
    starts = np.flatnonzero(np.concatenate([[True], ~cont]))
    return CopyPlan(dst[starts].copy(), src[starts].copy(), np.add.reduceat(lengths, starts).astype(np.uint64))
