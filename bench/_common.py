"""Small helpers shared by the benchmarks: timing with warm-up and medians, throughput, tables, progress.

Why medians: the benchmark machines are small and noisy (2 cores shared by the client, the daemon and whatever
else runs), so one slow iteration says more about the neighbours than about the code. Every measurement runs a
few untimed warm-up iterations (connections, caches, lazy imports, first-touch of pages), then timed iterations
until both a minimum count and a time budget are reached, and reports the median (plus p90 for context).
Per-iteration setup/teardown (fresh keys, releasing leases) runs outside the timed region.
"""

from __future__ import annotations

import json

import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Case", "Timed", "Samples", "interleave", "measure", "gbs", "fmt_bytes", "print_table", "progress"]


@dataclass(frozen=True)
class Samples:
    """Wall-clock seconds of each timed iteration."""

    seconds: tuple[float, ...]

    @property
    def p50(self) -> float:
        return statistics.median(self.seconds)

    @property
    def p90(self) -> float:
        s = sorted(self.seconds)
        return s[min(len(s) - 1, int(0.9 * len(s)))]

    @property
    def p99(self) -> float:
        s = sorted(self.seconds)
        return s[min(len(s) - 1, int(0.99 * len(s)))]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.seconds)

    def __len__(self) -> int:
        return len(self.seconds)


class Timed(float):
    """What a Case's fn returns when the operation ran, and was timed, in another process (bench.remote's
    Mooncake getter times its own call): the seconds it reports replace the wall time around fn."""


@dataclass(frozen=True)
class Case:
    """One thing to time: `fn(setup())` per iteration; setup and teardown (given setup's value) are untimed.
    A fn that returns Timed(seconds) is timed by that figure instead of the wall clock around it."""

    fn: Callable[[Any], object]
    setup: Callable[[], Any] | None = None
    teardown: Callable[[Any], object] | None = None

    def once(self) -> float:
        arg = self.setup() if self.setup is not None else None
        t0 = time.perf_counter()
        got = self.fn(arg)
        dt = time.perf_counter() - t0
        if isinstance(got, Timed):
            dt = float(got)
        if self.teardown is not None:
            self.teardown(arg)
        return dt


def interleave(cases: dict[str, Case], *, warmup: int = 3, min_iters: int = 5, max_iters: int = 10_000,
               budget_s: float = 1.0, block: int = 1, untimed_in_block: int = 0) -> dict[str, Samples]:
    """Time several cases round-robin: per round, `block` consecutive iterations of each case, the first
    `untimed_in_block` of them untimed.

    Why round-robin: on a noisy box a burst of foreign load lands on every case alike, so ratios between
    cases (store over memcpy) stay meaningful even when absolute numbers swing 2x between minutes.
    Why blocks (block > 1): a call that follows a pause (here: the other cases of the round) finds its peer
    process idle, and waking an idle process on this VM costs 50-200 us, more than a whole hot round trip;
    consecutive calls measure every case under the same hot condition, and the untimed head of each block
    absorbs the one cold call.
    Stops after `max_iters` rounds, or once `min_iters` rounds ran and every case had `budget_s` on average.
    """
    for _ in range(warmup):
        for c in cases.values():
            c.once()
    out: dict[str, list[float]] = {k: [] for k in cases}
    spent, rounds = 0.0, 0
    while rounds < max_iters and (rounds < min_iters or spent < budget_s * len(cases)):
        for k, c in cases.items():
            for i in range(block):
                dt = c.once()
                if i >= untimed_in_block:
                    out[k].append(dt)
                    spent += dt
        rounds += 1
    return {k: Samples(tuple(v)) for k, v in out.items()}


def measure(fn: Callable[[Any], object], *, setup: Callable[[], Any] | None = None,
            teardown: Callable[[Any], object] | None = None, **kw: Any) -> Samples:
    """`interleave` of a single case."""
    return interleave({"": Case(fn, setup, teardown)}, **kw)[""]


def gbs(nbytes: int, seconds: float) -> float:
    """Decimal GB/s, as the design notes quote them."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A table on stdout: rich when available, else aligned plain text (same content either way)."""
    cells = [[str(c) for c in r] for r in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
        print(f"\n{title}")
        print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
        for r in cells:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
        return
    table = Table(title=title, title_justify="left")
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right")
    for r in cells:
        table.add_row(*r)
    Console(file=sys.stdout, width=140).print(table)


class _NoProgress:
    """Stand-in when rich is missing: one line per step on stderr."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0

    def step(self, what: str) -> None:
        print(f"[{self.done}/{self.total}] {what}", file=sys.stderr, flush=True)

    def advance(self) -> None:
        self.done += 1

    def __enter__(self) -> _NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _RichProgress(_NoProgress):
    def __init__(self, total: int) -> None:
        super().__init__(total)
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        # stderr, so stdout keeps only the tables and the final JSON line
        self._p = Progress(TextColumn("{task.description:<44}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                           TimeElapsedColumn(), console=Console(stderr=True), transient=True)
        self._task = self._p.add_task("starting", total=total)

    def step(self, what: str) -> None:
        self._p.update(self._task, description=what)

    def advance(self) -> None:
        self._p.advance(self._task)

    def __enter__(self) -> _RichProgress:
        self._p.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._p.stop()


def progress(total: int) -> _NoProgress:
    """A progress bar on stderr (rich if installed); `.step(text)` names the current step, `.advance()` ends it."""
    try:
        import rich  # noqa: F401
    except ImportError:
        return _NoProgress(total)
    return _RichProgress(total)


# -- phase timing (added for bench/disk.py; generic) ------------------------------------------------------------
__all__ += ["timed", "TimedLock", "on_threads"]


def timed(acc: dict[str, float], phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap `fn` so that each call adds its wall seconds to `acc[phase]` (shadow a bound method with it on one
    instance, as micro's PhaseClock does: the benchmark sees the real call path)."""
    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[phase] += time.perf_counter() - t0
    return wrapper


class TimedLock:
    """A threading.Lock that adds the seconds spent acquiring it (waits, plus the timer's own cost) to
    `acc["lock wait"]`; usable wherever a Lock is (with, acquire/release, threading.Condition)."""

    def __init__(self, acc: dict[str, float]) -> None:
        self._lock, self._acc = threading.Lock(), acc

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        t0 = time.perf_counter()
        ok = self._lock.acquire(blocking, timeout)
        self._acc["lock wait"] += time.perf_counter() - t0
        return ok

    def release(self) -> None:
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


# -- the box a run measured (added for bench/disk.py; generic) --------------------------------------------------
__all__ += ["fs_type", "pressure"]


def fs_type(path: str) -> str:
    """Filesystem type of `path` (longest mount point prefix in /proc/mounts): tmpfs numbers are RAM numbers."""
    real, best, kind = os.path.realpath(path), "", "unknown"
    with open("/proc/mounts") as fh:
        for line in fh:
            mnt, typ = line.split()[1:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, typ
    return kind


def pressure() -> dict[str, float]:
    """Seconds some task stalled waiting for a CPU / for I/O since boot (Linux PSI 'some' totals; {} where
    unsupported). The delta over a run, divided by its length, says how noisy the box was while it ran."""
    out: dict[str, float] = {}
    for kind in ("cpu", "io"):
        try:
            with open(f"/proc/pressure/{kind}") as fh:
                out[kind] = int(fh.readline().rsplit("total=", 1)[1]) / 1e6
        except (OSError, IndexError, ValueError):
            pass
    return out


def emit_json(out: dict[str, Any], json_out: str | None = None) -> None:
    """The benchmark's last line: one JSON object (also written to ``json_out`` when given)."""
    line = json.dumps(out, sort_keys=True)
    if json_out:
        with open(json_out, "w") as fh:
            fh.write(line + "\n")
    print(line, flush=True)


__all__ += ["arena_for"]


def arena_for(working_bytes: int, spare_bytes: int = 0) -> int:
    """An arena (MiB-rounded) that holds `working_bytes` of blocks and `spare_bytes` of spare slots the
    clients hold ahead of their puts (kvstore/engine/spares.py: they count as allocated and may take at most
    1/8 of the arena) under the eviction watermark (0.9 used), with 64 MiB to spare: a benchmark that sized
    its arena to its blocks alone would time evictions its spare slots cause."""
    need = max(int((working_bytes + spare_bytes) / 0.9) + (64 << 20), 8 * spare_bytes)
    return -(-need // (1 << 20)) * (1 << 20)


def on_threads(part: Callable[[int], None], threads: int) -> float:
    """Run part(0..threads-1) on that many threads at once; the seconds from the start to the last one's end.
    Why threads started before the clock: thread creation is not what is measured."""
    start, errors = threading.Barrier(threads + 1), []

    def run(t: int) -> None:
        start.wait()
        try:
            part(t)
        except BaseException as exc:  # re-raised in the caller
            errors.append(exc)
    workers = [threading.Thread(target=run, args=(t,), daemon=True) for t in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    t0 = time.perf_counter()
    for w in workers:
        w.join()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return dt
