"""open()-time validation: rebuild the in-memory log state from the index and the files on disk.

The index is the source of truth for what exists; the files for what can be read. An entry survives only if
its bytes are inside an existing segment file of this configuration and the segment was not reused after it
was written (entry.seq >= the segment's persisted open_seq). Everything else is dropped in one transaction and
counted. Write pointers come back as max(offset + footprint) per segment: bytes past that point were never
committed (a crash between pwrite and commit) and are simply overwritten. The segments' persisted open_seq
restores FIFO age order, so reclamation after a restart continues with the truly oldest segment.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.tiers.disk.codec import CODEC_NAMES
from kvstore.tiers.disk.config import PAGE_BYTES, round_up
from kvstore.tiers.disk.index import IndexEntry, split_key
from kvstore.tiers.disk.state import StoreState

__all__ = ["Recovered", "recover"]


@dataclass
class Recovered:
    dropped: list[bytes]       # index keys found invalid (deleted unless the store is read-only)
    removed_files: int


def recover(state: StoreState, *, writable: bool) -> Recovered:
    cfg, table = state.config, state.table
    n = cfg.segments
    sizes = state.files.existing()
    removed = 0
    if writable:
        for seg in [s for s in sizes if s >= n]:   # capacity was lowered: these segments are gone
            state.files.remove(seg)
            removed += 1
    seg_seqs = state.index.segment_seqs()
    members: list[dict[bytes, int]] = [{} for _ in range(n)]
    wp, live = [0] * n, [0] * n
    ns_live: list[dict[int, int]] = [{} for _ in range(n)]
    max_seq = max(seg_seqs.values(), default=0)
    dropped: list[bytes] = []
    for ikey, e in state.index.all_entries():
        if not _valid(e, n, sizes, seg_seqs, cfg.segment_bytes):
            dropped.append(ikey)
            continue
        fp = round_up(e.stored_length)
        members[e.segment][ikey] = e.seq
        wp[e.segment] = max(wp[e.segment], e.offset + fp)
        live[e.segment] += fp
        ns_id = split_key(ikey)[0]
        ns_live[e.segment][ns_id] = ns_live[e.segment].get(ns_id, 0) + fp
        max_seq = max(max_seq, e.seq)
    for seg in range(n):
        open_seq = seg_seqs.get(seg, min(members[seg].values(), default=0))
        table.restore(seg, open_seq, members[seg], wp[seg], live[seg], ns_live[seg])
    table.arrange()
    state.next_seq = max_seq + 1
    if dropped and writable:
        state.index.delete(dropped)
    return Recovered(dropped, removed)


def _valid(e: IndexEntry, n: int, sizes: dict[int, int], seg_seqs: dict[int, int], segment_bytes: int) -> bool:
    if not 0 <= e.segment < n or e.segment not in sizes:
        return False
    if e.codec not in CODEC_NAMES or e.length <= 0 or e.stored_length <= 0 or e.offset % PAGE_BYTES:
        return False
    if e.offset + round_up(e.stored_length) > segment_bytes:
        return False
    if e.offset + e.stored_length > sizes[e.segment]:   # the file was truncated under this entry
        return False
    return e.seq >= seg_seqs.get(e.segment, 0)
