"""Checks a RAM journal's records against the arena they describe, before a successor serves one of their blocks.

A record passes when (each a reason it is dropped and counted under, in this order):

    header      its header hash holds (journal.scan: a torn or damaged record is never read further)
    geometry    its slot lies inside one slab of the data region, page-aligned, 1..slab bytes long
    generation  the slot's generation word in the arena is the one the record was written with (a slot
                freed since, by eviction or the predecessor's own adoption, never matches again)
    unchecked   it carries an xxh3 of its block (a block committed without one and never hashed cannot be
                told from other bytes: not served)
    checksum    the block's bytes hash to that xxh3 now

Hashing is the cost (~6-20 GB/s a core here): it runs on `threads` threads (xxhash releases the GIL), and a
hand-over does it twice over time, not in its window: once while the old daemon still serves (`known` is then
empty), and at the hand-over itself only for records that changed since (`known`: what passed before, by
entry id; a record equal to it whose generation still holds was the same block, whose bytes never change
while it is committed).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import xxhash

from kvstore.arena.journal import JournalEntries
from kvstore.arena.layout import ArenaLayout

__all__ = ["Verification", "verify", "REASONS", "Fingerprint"]

REASONS = ("header", "geometry", "generation", "unchecked", "checksum")
Fingerprint = tuple[int, int, int, int, int]  # serial, offset, size, generation, checksum
_CHUNK_BYTES = 64 << 20  # hashing work handed to a thread at once


@dataclass
class Verification:
    ok: np.ndarray                 # bool per scanned record
    dropped: dict[str, int] = field(default_factory=dict)
    hashed_blocks: int = 0
    hashed_bytes: int = 0
    passed: dict[int, Fingerprint] = field(default_factory=dict)  # entry id -> what passed (the next `known`)

    def drop(self, reason: str, n: int) -> None:
        if n:
            self.dropped[reason] = self.dropped.get(reason, 0) + n


def verify(scan: JournalEntries, layout: ArenaLayout, view: np.ndarray, generations: np.ndarray, *,
           known: dict[int, Fingerprint] | None = None, threads: int = 0) -> Verification:
    rec = scan.records
    out = Verification(np.ones(len(rec), dtype=bool))
    out.drop("header", scan.bad_headers)
    offsets, sizes = rec["offset"].astype(np.int64), rec["size"].astype(np.int64)
    rel = offsets - layout.data_offset
    geometry = ((rel >= 0) & (sizes > 0) & (sizes <= layout.slab_bytes) & (rel % layout.page_bytes == 0)
                & (offsets + sizes <= layout.size_bytes))
    safe_rel = np.where(geometry, rel, 0)
    geometry &= (safe_rel // layout.slab_bytes) == ((safe_rel + np.maximum(sizes, 1) - 1) // layout.slab_bytes)
    out.drop("geometry", int((~geometry).sum()))
    out.ok &= geometry
    gen_now = np.zeros(len(rec), dtype=np.uint64)
    idx = np.flatnonzero(out.ok)
    gen_now[idx] = generations[layout.generation_indices(offsets[idx])]
    same_gen = gen_now == rec["gen"]
    out.drop("generation", int((out.ok & ~same_gen).sum()))
    out.ok &= same_gen
    has_sum = rec["checksum"] != 0
    out.drop("unchecked", int((out.ok & ~has_sum).sum()))
    out.ok &= has_sum
    prints = list(zip(rec["serial"].tolist(), offsets.tolist(), sizes.tolist(), rec["gen"].tolist(),
                      rec["checksum"].tolist()))
    known = known or {}
    todo = [i for i in np.flatnonzero(out.ok).tolist() if known.get(int(scan.eids[i])) != prints[i]]
    good = _hash_all(view, [(offsets[i], sizes[i], int(rec["checksum"][i])) for i in todo], threads)
    bad = [i for i, g in zip(todo, good) if not g]
    out.ok[bad] = False
    out.drop("checksum", len(bad))
    out.hashed_blocks, out.hashed_bytes = len(todo), int(sum(int(sizes[i]) for i in todo))
    out.passed = {int(scan.eids[i]): prints[i] for i in np.flatnonzero(out.ok).tolist()}
    return out


def _hash_all(view: np.ndarray, jobs: list[tuple[int, int, int]], threads: int) -> list[bool]:
    """Whether each (offset, size, xxh3) block hashes to its digest, on up to `threads` threads."""
    if not jobs:
        return []
    chunks: list[list[int]] = [[]]
    room = _CHUNK_BYTES
    for i, (_, size, _) in enumerate(jobs):
        if room <= 0:
            chunks.append([])
            room = _CHUNK_BYTES
        chunks[-1].append(i)
        room -= int(size)

    def run(chunk: list[int]) -> list[tuple[int, bool]]:
        return [(i, xxhash.xxh3_64_intdigest(view[jobs[i][0]: jobs[i][0] + jobs[i][1]].data) == jobs[i][2])
                for i in chunk]

    n = threads or min(8, os.cpu_count() or 1)
    results = [False] * len(jobs)
    if n <= 1 or len(chunks) == 1:
        pairs = [p for c in chunks for p in run(c)]
    else:
        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="kvstore-verify") as pool:
            pairs = [p for got in pool.map(run, chunks) for p in got]
    for i, ok in pairs:
        results[i] = ok
    return results
