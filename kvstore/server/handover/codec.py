"""The hand-over's state as message bodies and blobs, and back, every field checked on the way in.

What travels in FROZEN (protocol.py): the engine's live state (kvstore/engine/adoption.py LiveState), the session
book, the shared key index's counters and the peer tier's etcd lease. Entry ids, offsets and deadlines that a
damaged message could carry are only ever used against what the successor verified itself (adoption.py drops
what does not match), so the checks here are about shape: a wrong type or a negative count is a HandoverError.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.engine.adoption import HeldEntry, LiveState
from kvstore.engine.sessions import SessionEntry
from kvstore.origins import BlockOrigin
from kvstore.server.handover.protocol import HandoverError

__all__ = ["encode_live", "decode_live", "encode_sessions", "decode_sessions", "encode_origins", "decode_origins"]

_U64 = (1 << 64) - 1


def encode_live(live: LiveState) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    lease_ids = [e for _, eids, _ in live.leases for e in eids]
    res_ids = [e for _, _, eids, _ in live.reservations for e in eids]
    body = {
        "serial": live.serial, "lease_next_id": live.lease_next_id, "reservation_next_id": live.reservation_next_id,
        "leases": [[lid, len(eids), left] for lid, eids, left in live.leases],
        "reservations": [[rid, ns, len(eids), left] for rid, ns, eids, left in live.reservations],
        "reserved": [_held(h) for h in live.reserved], "doomed": [_held(h) for h in live.doomed],
        "held": [[off, cls, left] for off, cls, left in live.held],
        "pins": [[eid, n] for eid, n in live.pins.items()],
        "hint_pins": [[eid, left] for eid, left in live.hint_pins],
        "priorities": [[eid, p, left] for eid, p, left in live.priorities],
    }
    blobs = {"order": np.asarray(live.order, dtype="<i8"), "lease_eids": np.asarray(lease_ids, dtype="<i8"),
             "reservation_eids": np.asarray(res_ids, dtype="<i8")}
    return body, blobs


def _held(h: HeldEntry) -> list[Any]:
    return [h.eid, h.ns_id, h.key.hex(), h.offset, h.size, h.serial]


def decode_live(body: dict[str, Any], blobs: dict[str, np.ndarray]) -> LiveState:
    try:
        live = LiveState(serial=_int(body["serial"]), lease_next_id=_int(body["lease_next_id"]),
                         reservation_next_id=_int(body["reservation_next_id"]))
        lease_eids = _ids(blobs["lease_eids"])
        at = 0
        for lid, n, left in body["leases"]:
            live.leases.append((_int(lid), lease_eids[at: at + _int(n)], _secs(left)))
            at += _int(n)
        res_eids = _ids(blobs["reservation_eids"])
        at = 0
        for rid, ns, n, left in body["reservations"]:
            live.reservations.append((_int(rid), _int(ns), res_eids[at: at + _int(n)], _secs(left)))
            at += _int(n)
        live.reserved = [_entry(x) for x in body["reserved"]]
        live.doomed = [_entry(x) for x in body["doomed"]]
        live.held = [(_int(off), _int(cls), _secs(left)) for off, cls, left in body["held"]]
        live.pins = {_int(eid): _int(n) for eid, n in body["pins"]}
        live.hint_pins = [(_int(eid), _secs(left)) for eid, left in body["hint_pins"]]
        live.priorities = [(_int(eid), int(p), _secs(left)) for eid, p, left in body["priorities"]]
        live.order = _ids(blobs["order"])
        return live
    except (KeyError, TypeError, ValueError) as exc:
        raise HandoverError(f"malformed live state in the hand-over: {exc!r}") from exc


def _entry(x: list[Any]) -> HeldEntry:
    eid, ns, key, off, size, serial = x
    raw = bytes.fromhex(key)
    if not 0 < len(raw) <= 64:
        raise ValueError(f"key of {len(raw)} bytes")
    return HeldEntry(_int(eid), _int(ns), raw, _int(off), _int(size), _int(serial))


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= _U64:
        raise ValueError(f"{v!r} is not a count")
    return v


def _secs(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e7:
        raise ValueError(f"{v!r} is not a number of seconds")
    return float(v)


def _ids(a: np.ndarray) -> list[int]:
    if a.dtype != np.dtype("<i8") or (len(a) and int(a.min()) < 0):
        raise ValueError("entry ids must be non-negative int64")
    return a.tolist()


def encode_sessions(entries: list[SessionEntry], ages: list[float]) -> list[list[Any]]:
    """The session book, oldest note first, with each entry's age."""
    return [[e.session, e.namespace, [k.hex() for k in e.keys], age, e.ended]
            for e, age in zip(reversed(entries), reversed(ages))]


def decode_sessions(raw: Any) -> list[tuple[str, str, list[bytes], float, bool]]:
    try:
        out = []
        for session, ns, keys, age, ended in raw:
            if not isinstance(session, str) or not isinstance(ns, str) or not isinstance(ended, bool):
                raise ValueError("session fields")
            out.append((session, ns, [bytes.fromhex(k) for k in keys], _secs(age), ended))
        return out
    except (TypeError, ValueError) as exc:
        raise HandoverError(f"malformed session book in the hand-over: {exc!r}") from exc


MAX_ORIGINS = 1 << 20  # vLLM identities carried (the KV events' names of held blocks); past it, blocks go by key


def encode_origins(items: list[tuple[str, bytes, BlockOrigin]]) -> tuple[list[list[Any]], np.ndarray]:
    """The KV event publisher's vLLM identities of held blocks: one row each, their token ids in one blob."""
    items = items[:MAX_ORIGINS]
    rows = [[ns, key.hex(), [h.hex() for h in o.block_hashes], (o.parent_block_hash or b"").hex(), o.block_size,
             o.lora_name or "", len(o.token_ids)] for ns, key, o in items]
    tokens = np.concatenate([np.frombuffer(o.token_ids, dtype=np.int64) for _, _, o in items]) if items else \
        np.zeros(0, dtype=np.int64)
    return rows, tokens.astype("<i8")


def decode_origins(raw: Any, tokens: Any) -> list[tuple[str, bytes, BlockOrigin]]:
    try:
        toks = np.asarray(tokens if tokens is not None else np.zeros(0), dtype=np.int64)
        out, at = [], 0
        for ns, key, hashes, parent, block_size, lora, n in raw:
            if not isinstance(ns, str) or not isinstance(lora, str) or not hashes:
                raise ValueError("origin fields")
            n = _int(n)
            if at + n > len(toks):
                raise ValueError("token ids past the blob")
            out.append((ns, bytes.fromhex(key), BlockOrigin.of([bytes.fromhex(h) for h in hashes],
                                                              bytes.fromhex(parent) or None,
                                                              toks[at: at + n].tolist(), _int(block_size), lora)))
            at += n
        return out
    except (TypeError, ValueError) as exc:
        raise HandoverError(f"malformed KV event identities in the hand-over: {exc!r}") from exc
