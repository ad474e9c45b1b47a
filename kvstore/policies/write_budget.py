"""The disk write budget: admit blocks to the SSD at a chosen rate, refusing larger blocks first.

Why: every block written costs flash endurance, and a node that writes every victim (or every commit) wears its
disk at the rate the store turns over, whatever that buys in hits. A budget in bytes per second, averaged over
a window, bounds the wear the way CacheLib's flash cache bounds it with a daily write budget and its dynamic
random admission (DynamicRandomAP): a block offered for writing is admitted with a probability that follows
the budget, so the write rate tracks the budget instead of the demand, and which blocks go is spread evenly
over time instead of first come, first served.

The rule (one window = `window_s` seconds on the given clock, the daemon's monotonic one):

    target    T = bytes_per_s x window_s bytes a window.
    p         at the start of each window: T / (bytes offered in the window before), at most 1 (1 when nothing
              was offered, and in the first window). Steady demand D per window is then admitted at about T.
    a block   of `size` bytes is admitted with probability min(1, p x mean / size), `mean` being the mean
              size of the blocks offered in the window before (the first window: the block's own size). So
              blocks larger than the usual go first: with one block size (one model) that is p for all.
    the cap   once T bytes were admitted in the current window every further offer is refused: a burst never
              pushes a window past its budget, so the rate averaged over any window stays within it.

The draws come from a seeded PRNG, one per decision: the replay's simulator (bench/replay) drives this class
with the trace's clock and makes the same decisions in the same order. Like the eviction policies it only
decides: no I/O and no lock (the engine calls it under its lock). `state()` is what Stats and the metrics
report: the current probability, the window's admitted bytes against its target, and the totals.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.errors import ConfigError

__all__ = ["WriteBudget", "BudgetState", "check_budget", "MAX_BUDGET_BYTES_PER_S", "MIN_WINDOW_S", "MAX_WINDOW_S"]

MAX_BUDGET_BYTES_PER_S = 64 << 30   # 64 GiB/s: past any SSD (or a RAID of them); more is a units mistake
MIN_WINDOW_S = 1.0
MAX_WINDOW_S = 86400.0              # a day: CacheLib's budgets are daily


def check_budget(bytes_per_s: int, window_s: float, max_block_bytes: int) -> None:
    """ConfigError naming the setting when the budget cannot mean what was asked (0, negative, absurd, or too small
    to ever write the largest block)."""
    if isinstance(bytes_per_s, bool) or not isinstance(bytes_per_s, int):
        raise ConfigError(f"invalid config: disk_write_budget={bytes_per_s!r}: use a size per second such as "
                          "'200MiB', or '' for no budget")
    if bytes_per_s <= 0:
        raise ConfigError(f"invalid config: disk_write_budget={bytes_per_s}: a budget must be > 0 bytes per second "
                          "(to stop disk writes set disk_admission = never; for no budget leave it '')")
    if bytes_per_s > MAX_BUDGET_BYTES_PER_S:
        raise ConfigError(f"invalid config: disk_write_budget={bytes_per_s} bytes/s is more than "
                          f"{MAX_BUDGET_BYTES_PER_S >> 30} GiB/s, past any disk: it is in bytes per second (e.g. "
                          "'500MiB'); leave it '' for no budget")
    if (isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or not math.isfinite(window_s)
            or not MIN_WINDOW_S <= window_s <= MAX_WINDOW_S):
        raise ConfigError(f"invalid config: disk_write_budget_window_s={window_s!r}: use {MIN_WINDOW_S:g} to "
                          f"{MAX_WINDOW_S:g} seconds (the span the budget is averaged over)")
    if bytes_per_s * window_s < max_block_bytes:
        raise ConfigError(f"invalid config: disk_write_budget={bytes_per_s} bytes/s over a {window_s:g} s window "
                          f"is less than one block of max_block_bytes ({max_block_bytes}): no block could ever be "
                          "written; raise the budget or the window")


@dataclass(frozen=True)
class BudgetState:
    """What the budget did and where it stands (Stats, metrics)."""

    bytes_per_s: int
    window_s: float
    probability: float        # the current window's base admission probability
    window_admitted: int      # bytes admitted in the current window ...
    window_target: int        # ... against this many
    admitted_bytes: int       # totals since start
    admitted_blocks: int
    refused_bytes: int
    refused_blocks: int


class WriteBudget:
    """Dynamic random admission over `bytes_per_s` averaged over `window_s` (see the module docstring)."""

    def __init__(self, bytes_per_s: int, window_s: float = 60.0, *, clock: Callable[[], float] = time.monotonic,
                 seed: int = 0, max_block_bytes: int = 1) -> None:
        check_budget(bytes_per_s, window_s, max_block_bytes)
        self.bytes_per_s = bytes_per_s
        self.window_s = float(window_s)
        self.target = int(bytes_per_s * window_s)
        self._clock = clock
        self._rng = random.Random(seed)
        self._start: float | None = None  # the clock at the first offer: windows count from it
        self._window = 0
        self._p = 1.0
        self._offered = self._offered_blocks = 0     # this window
        self._admitted_now = 0                       # this window
        self._mean = 0.0                             # mean offered size of the previous window (0: none yet)
        self.admitted_bytes = self.admitted_blocks = self.refused_bytes = self.refused_blocks = 0

    def admit(self, size: int) -> bool:
        """Offer one block of `size` bytes: True to write it (its bytes count against the window)."""
        self._roll()
        self._offered += size
        self._offered_blocks += 1
        p = self._p if self._mean <= 0 else min(1.0, self._p * self._mean / size)
        ok = self._admitted_now + size <= self.target and (p >= 1.0 or self._rng.random() < p)
        if ok:
            self._admitted_now += size
            self.admitted_bytes += size
            self.admitted_blocks += 1
        else:
            self.refused_bytes += size
            self.refused_blocks += 1
        return ok

    def charge(self, size: int) -> None:
        """Bytes written outside admission (a Demote hint bypasses it): they count against the window."""
        self._roll()
        self._admitted_now += size
        self.admitted_bytes += size
        self.admitted_blocks += 1

    def _roll(self) -> None:
        """Move to the clock's window; a new window sets p and the mean size from the one before it."""
        now = self._clock()
        if self._start is None:
            self._start = now
        window = int((now - self._start) // self.window_s)
        if window == self._window:
            return
        recent = window == self._window + 1  # else whole windows went by with no offer at all
        offered, blocks = (self._offered, self._offered_blocks) if recent else (0, 0)
        self._p = 1.0 if offered <= self.target else self.target / offered
        if blocks:
            self._mean = offered / blocks
        self._window = window
        self._offered = self._offered_blocks = self._admitted_now = 0

    def state(self) -> BudgetState:
        if self._start is not None:
            self._roll()
        return BudgetState(self.bytes_per_s, self.window_s, round(self._p, 6), self._admitted_now, self.target,
                           self.admitted_bytes, self.admitted_blocks, self.refused_bytes, self.refused_blocks)
