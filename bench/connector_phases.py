"""Where the connector benchmark's time goes: one instrumented save and load, outside the medians.

`instrument` shadows the worker's calls (RPCs, the native copy, the copy plan) with timers on the instances it
uses, so nothing in kvstore_connector/ knows it is being measured; `profile` runs one save and one load of a
bench.connector Bench (bench/connector_rig.py) that way and reports ms per phase next to the wall time of the pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from bench._common import gbs, timed
from kvstore_connector.worker import WorkerSide
from kvstore.client import arena_path

if TYPE_CHECKING:
    from bench.connector_rig import Bench

__all__ = ["instrument", "profile"]


def instrument(w: WorkerSide, acc: dict[str, float]) -> Callable[[], None]:
    """Time the worker's calls by shadowing bound methods on the instances it uses; returns the undo."""
    c = w._client()
    if c is None:
        raise RuntimeError("the worker side has no arena client")
    m = c.acquire_arena()
    if m is None:
        raise RuntimeError("the worker's client has no arena mapping")
    with m:
        copier = w._copier_for(m)  # the copier is made on first use: make it now, to wrap it
    layout = w.layout
    assert layout is not None
    names = [(c, "reserve_many", "Reserve RPC"), (c, "commit", "Commit RPC"), (c, "lookup", "Lookup RPC"),
             (c, "release", "Release (queued)"), (arena_path, "validated", "generation check"),
             (copier, "copy", "copy (native)"), (layout, "plan", "copy plan")]
    # a save of up to BANKED_KEYS keys a part goes through spare slots (kvstore_connector/saves.py): taken on vLLM's
    # thread with no request, stored by one Store RPC on the commit thread
    banks = {id(b): b for g in range(len(w.layouts)) if (b := c.slot_bank(w.group_key_bytes(g))) is not None}
    for bank in banks.values():
        names += [(bank, "take", "spare slots taken"), (bank, "store", "Store RPC")]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in names]
    for obj, attr, phase in names:
        acc.setdefault(phase, 0.0)
        setattr(obj, attr, timed(acc, phase, getattr(obj, attr)))

    def undo() -> None:
        for obj, attr, original in saved:
            if obj is arena_path:
                setattr(obj, attr, original)
            else:
                delattr(obj, attr)
    return undo


def profile(b: Bench, t: int, chunk: int, tick: Callable[[str], None]) -> dict[str, dict[str, float]]:
    """One instrumented save and load (outside the medians): ms per phase, and the wall ms of the pass."""
    w = b.workers[t]
    out: dict[str, dict[str, float]] = {}
    for name, case in (("save", b.save_case(t, chunk, tick)), ("load", b.load_case(t, tick))):
        acc: dict[str, float] = {}
        arg = case.setup() if case.setup is not None else None
        undo = instrument(w, acc)
        try:
            t0 = time.perf_counter()
            case.fn(arg)
            wall = time.perf_counter() - t0
        finally:
            undo()
        if case.teardown is not None:
            case.teardown(arg)
        out[name] = {k: round(v * 1e3, 1) for k, v in acc.items() if v > 0}
        out[name]["wall"] = round(wall * 1e3, 1)
        out[name]["GB/s"] = round(gbs(b.nbytes, wall), 2)
    return out
