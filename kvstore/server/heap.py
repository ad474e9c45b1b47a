"""The daemon's garbage collector, set so that no collector pass runs inside a request: `settle()` once serving.

Why: CPython's cyclic collector runs a young-generation pass every 700 net container allocations, a middle one
every tenth of those and a full one after that, each holding the GIL for its whole length. A daemon serving
loads allocates a few hundred containers per request (frames, key lists, plans, futures), so it paused every
few dozen requests, and now and then for a full pass over every object it ever built. A peer tier multiplies a
pause into other nodes' tails: a Lookup at N nodes waits for the slowest of its N - 1 peers, any of which may
be mid-pass. `python -m bench.gc_pauses` (three daemons on one etcd; loads of 64 blocks, 16 fetched from a peer;
a cluster whose collector never runs is the limit, in the same run): CPython's defaults ran 37 passes per 1,000
loads, the longest 3.2 ms (39 ms, a full pass, in a quick run); settled, none ran during the loads. p50 and
p99 sit within this box's noise either way (p99 0.96-0.98 of the limit), p99.9 9.1 ms settled against 11.1 ms.

What it does:
- collects once and freezes what survives (`gc.freeze`): the modules, configuration and the engine's
  structures built at startup live as long as the process, and a frozen object is never traversed again, so a
  full pass no longer walks them;
- raises the young-generation threshold (gc_young_threshold, GEN0_THRESHOLD by default): request garbage is
  freed by reference counting the moment it is dropped (no cycles), so a pass finds little and may run ~14x less
  often; a pass walks only the young objects still alive at that moment, so it does not grow with the threshold.

Nothing here turns collection off: reference cycles are still found, only less often.
"""

from __future__ import annotations

import gc
import logging

__all__ = ["settle", "GEN0_THRESHOLD", "MIN_GEN0", "MAX_GEN0"]

log = logging.getLogger(__name__)

GEN0_THRESHOLD = 10_000          # the default of the gc_young_threshold setting
MIN_GEN0, MAX_GEN0 = 700, 1_000_000  # CPython's own default, and far past where a pass still finds garbage


def settle(young_threshold: int) -> int:
    """Collect, freeze the survivors, set the young threshold; the number of objects frozen. 0 leaves the
    collector as CPython set it (the gc_young_threshold setting's off switch)."""
    if not young_threshold:
        log.info("heap: CPython's collector defaults kept (gc_young_threshold 0)")
        return 0
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(young_threshold, gen1, gen2)
    frozen = gc.get_freeze_count()
    log.info("heap settled: %d startup objects frozen, young-generation threshold %d", frozen, young_threshold)
    return frozen
