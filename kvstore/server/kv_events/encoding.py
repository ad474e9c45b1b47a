"""vLLM's KV event batches as msgpack bytes: the encoding vLLM 0.33 emits, and a decoder of both it has used.

vLLM encodes with msgspec: ``EventBatch`` is array-like, ``[ts, events, data_parallel_rank]`` (the rank written
as nil when unset: omit_defaults leaves array fields in place), and each event, since vLLM's tag=True structs became maps (0.33), is a map whose first key ``"type"`` names its
class, then its fields in declaration order; fields left at their default are omitted (omit_defaults), required
ones always written (None as nil). Before that, events were array-like too: ``["BlockStored", hashes, parent,
token_ids, block_size, lora_id, medium, lora_name, ...]``. `encode_batch` writes the first form, byte for byte as
vLLM's own encoder (tests/vllm_sched/test_vllm_kv_events.py compares them); `decode_batch` reads both, into the
values of vllm_events.py (fields this daemon does not use are dropped).

A frame on the wire (publisher.py) is vLLM's: (topic, 8-byte big-endian sequence number, this payload).
"""

from __future__ import annotations

from typing import Any

import msgpack

from kvstore.server.kv_events.vllm_events import AllBlocksCleared, BlockRemoved, BlockStored, VllmEvent

__all__ = ["encode_batch", "decode_batch", "event_map"]

# the fields of vLLM 0.33's structs, in declaration order; None: required (always written)
_STORED_REQUIRED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_STORED_ARRAY = _STORED_REQUIRED + ("extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                                    "locality", "ownership")
_REMOVED_ARRAY = ("block_hashes", "medium", "group_idx", "locality", "ownership")


def event_map(e: VllmEvent) -> dict[str, Any]:
    """One event as vLLM 0.33's encoder lays it out: the tag, required fields, then non-default optional ones."""
    if isinstance(e, BlockStored):
        return {"type": "BlockStored", "block_hashes": list(e.block_hashes), "parent_block_hash": e.parent_block_hash,
                "token_ids": list(e.token_ids), "block_size": e.block_size, "lora_id": None, "medium": e.medium,
                "lora_name": e.lora_name, "ownership": e.ownership}
    if isinstance(e, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(e.block_hashes), "medium": e.medium,
                "ownership": e.ownership}
    return {"type": "AllBlocksCleared"}


_PACKER = msgpack.Packer(use_bin_type=True)
# msgspec sizes a struct's map header for the most fields it could write: BlockStored has 15 fields and the tag,
# so its header is always a map16, whatever the count; BlockRemoved's and AllBlocksCleared's are fixmaps
_MAP16 = frozenset({"BlockStored"})


def _event_bytes(m: dict[str, Any]) -> bytes:
    body = b"".join(_PACKER.pack(k) + _PACKER.pack(v) for k, v in m.items())
    header = b"\xde" + len(m).to_bytes(2, "big") if m["type"] in _MAP16 else _PACKER.pack_map_header(len(m))
    return header + body


def encode_batch(ts: float, events: list[VllmEvent]) -> bytes:
    """A KVEventBatch payload, byte for byte as msgspec writes it; data_parallel_rank nil: the daemon is no
    data-parallel rank of a vLLM."""
    return (_PACKER.pack_array_header(3) + _PACKER.pack(float(ts)) + _PACKER.pack_array_header(len(events))
            + b"".join(_event_bytes(event_map(e)) for e in events) + _PACKER.pack(None))


def decode_batch(payload: bytes) -> tuple[float, list[VllmEvent]]:
    """(ts, events) from either encoding; ValueError for anything else."""
    try:
        batch = msgpack.unpackb(payload, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"not a msgpack event batch: {exc}") from exc
    if not isinstance(batch, list) or len(batch) not in (2, 3) or not isinstance(batch[1], list):
        raise ValueError(f"an event batch is [ts, events(, dp_rank)], got {type(batch).__name__}")
    return float(batch[0]), [_event(e) for e in batch[1]]


def _event(raw: Any) -> VllmEvent:
    if isinstance(raw, dict):
        tag, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = {"BlockStored": _STORED_ARRAY, "BlockRemoved": _REMOVED_ARRAY}.get(tag, ())
        fields = dict(zip(names, raw[1:]))
    else:
        raise ValueError(f"an event is a tagged map or a tagged array, got {raw!r:.80}")
    if tag == "BlockStored":
        return BlockStored(tuple(fields["block_hashes"]), fields.get("parent_block_hash"),
                           tuple(fields.get("token_ids") or ()), int(fields.get("block_size") or 0),
                           fields.get("medium") or "", fields.get("lora_name"), fields.get("ownership") or "")
    if tag == "BlockRemoved":
        return BlockRemoved(tuple(fields["block_hashes"]), fields.get("medium") or "", fields.get("ownership") or "")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown event type {tag!r}")
