"""`kvstore top`: a live view of one daemon, refreshed from two successive `Client.stats()` snapshots.

Every figure "over the last interval" is a difference of cumulative counters between two snapshots divided by
the time measured between them (not the nominal --interval, which sleeping and RPCs stretch). The first frame
therefore appears after one interval: there is nothing honest to show for "the last interval" before that.
`build_view` is a pure function of two snapshots so that the arithmetic is tested without a terminal; the
loop around it only samples, draws (rich `Live`) and watches the keyboard.

Token hit rates cover the namespaces registered with tokens_per_block (keys x tokens per block, per tier);
the row is left out while no namespace has one.

A daemon restart (uptime going backwards) resets its counters; the view then counts from zero rather than
showing negative rates.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import termios
import threading
import time
import tty
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvstore.cli import render
from kvstore.client import Client
from kvstore.client.types import NamespaceStats, Stats

__all__ = ["Hits", "NamespaceRow", "TopView", "build_view", "view_doc", "render_view", "run", "TOP_NAMESPACES"]

TOP_NAMESPACES = 10
_BAR_WIDTH = 30


@dataclass(frozen=True)
class Hits:
    """Keys looked up and found per tier over some span; rates are shares of `lookups`."""

    lookups: int
    ram: int
    disk: int
    peer: int = 0     # Lookups without lease that found keys on peers (fetched in the background)

    @property
    def all(self) -> int:
        return self.ram + self.disk + self.peer

    def rate(self, found: int) -> float | None:
        return found / self.lookups if self.lookups else None


@dataclass(frozen=True)
class NamespaceRow:
    name: str
    lookups: int          # last interval
    hits: int             # last interval
    lookups_total: int
    hits_total: int
    blocks: int
    bytes: int


@dataclass(frozen=True)
class TopView:
    """One frame: cumulative figures, figures over the last interval, and gauges at its end."""

    node_id: str
    uptime_s: float
    interval_s: float
    total: Hits
    recent: Hits
    committed_bytes_per_s: float
    read_bytes_per_s: float
    disk_write_bytes_per_s: float
    disk_read_bytes_per_s: float
    evictions: int
    evictions_per_s: float
    promotions: int
    promotions_per_s: float
    ram_allocated_bytes: int
    ram_capacity_bytes: int
    blocks: int
    disk_used_bytes: int | None       # None: the daemon runs without a disk tier
    disk_capacity_bytes: int | None
    disk_blocks: int | None
    leases_active: int
    reservations_active: int
    disk_state: str                   # "off", "healthy" or "DEGRADED: <reason>"
    namespaces: list[NamespaceRow]
    tokens_total: Hits | None = None  # in tokens (namespaces with tokens_per_block); None: no such namespace
    tokens_recent: Hits | None = None


def _hits(c: dict[str, int]) -> Hits:
    return Hits(c.get("lookup_keys", 0), c.get("hit_keys_ram", 0), c.get("hit_keys_disk", 0),
                c.get("hit_keys_peer", 0))


def _tokens(namespaces: list[NamespaceStats]) -> Hits:
    known = [n for n in namespaces if n.tokens_per_block]
    return Hits(sum(n.lookup_keys * n.tokens_per_block for n in known),
                sum(n.hit_keys_ram * n.tokens_per_block for n in known),
                sum(n.hit_keys_disk * n.tokens_per_block for n in known),
                sum(n.hit_keys_peer * n.tokens_per_block for n in known))


def _disk_state(s: Stats) -> str:
    if s.disk is None:
        return "off"
    return f"DEGRADED: {s.disk.degraded_reason or 'no reason given'}" if s.disk.degraded else "healthy"


def build_view(prev: Stats, cur: Stats, elapsed_s: float) -> TopView:
    """The frame for the span between two snapshots of the same daemon, `elapsed_s` seconds apart."""
    restarted = cur.uptime_s < prev.uptime_s
    c, p = cur.counters, ({} if restarted else prev.counters)
    dt = max(elapsed_s, 1e-9)

    def delta(name: str) -> int:
        return c.get(name, 0) - p.get(name, 0)

    disk_w = disk_r = 0
    if cur.disk is not None:
        disk_before = None if restarted else prev.disk
        disk_w = cur.disk.bytes_written - (disk_before.bytes_written if disk_before else 0)
        disk_r = cur.disk.bytes_read - (disk_before.bytes_read if disk_before else 0)
    old = {} if restarted else {n.name: n for n in prev.namespaces}
    rows = []
    for n in cur.namespaces:
        o = old.get(n.name)
        rows.append(NamespaceRow(n.name, n.lookup_keys - (o.lookup_keys if o else 0),
                                 n.hit_keys - (o.hit_keys if o else 0), n.lookup_keys, n.hit_keys, n.blocks, n.bytes))
    rows.sort(key=lambda r: (-r.lookups, -r.lookups_total, r.name))
    tokens = _tokens(cur.namespaces)
    before = _tokens([] if restarted else prev.namespaces)
    with_tokens = any(n.tokens_per_block for n in cur.namespaces)
    return TopView(
        node_id=cur.node_id, uptime_s=cur.uptime_s, interval_s=elapsed_s,
        total=_hits(c), recent=Hits(delta("lookup_keys"), delta("hit_keys_ram"), delta("hit_keys_disk"),
                                          delta("hit_keys_peer")),
        committed_bytes_per_s=delta("committed_bytes") / dt,
        read_bytes_per_s=(delta("hit_bytes_ram") + delta("hit_bytes_disk")) / dt,
        disk_write_bytes_per_s=disk_w / dt, disk_read_bytes_per_s=disk_r / dt,
        evictions=c.get("evictions", 0), evictions_per_s=delta("evictions") / dt,
        promotions=c.get("promotions", 0), promotions_per_s=delta("promotions") / dt,
        ram_allocated_bytes=cur.allocated_bytes, ram_capacity_bytes=cur.capacity_bytes, blocks=cur.blocks,
        disk_used_bytes=cur.disk.used_bytes if cur.disk else None,
        disk_capacity_bytes=cur.disk.capacity_bytes if cur.disk else None,
        disk_blocks=cur.disk.blocks if cur.disk else None,
        leases_active=cur.leases_active, reservations_active=cur.reservations_active,
        disk_state=_disk_state(cur), namespaces=rows[:TOP_NAMESPACES],
        tokens_total=tokens if with_tokens else None,
        tokens_recent=Hits(tokens.lookups - before.lookups, tokens.ram - before.ram, tokens.disk - before.disk,
                           tokens.peer - before.peer)
        if with_tokens else None,
    )


def view_doc(v: TopView) -> dict[str, Any]:
    """The --json document: the frame's fields plus the hit rates (null when nothing was looked up)."""
    doc = asdict(v)
    for span, hits in (("total", v.total), ("recent", v.recent), ("tokens_total", v.tokens_total),
                       ("tokens_recent", v.tokens_recent)):
        if hits is None:
            continue
        doc[span]["hit_rate"] = {"ram": hits.rate(hits.ram), "disk": hits.rate(hits.disk),
                                 "peer": hits.rate(hits.peer), "all": hits.rate(hits.all)}
    return doc


# -- drawing ------------------------------------------------------------------------------------------------
def _share(found: int, lookups: int) -> str:
    return f"{render.pct(found / lookups)} ({found}/{lookups})" if lookups else "-"


def _rate(bytes_per_s: float) -> str:
    return render.human_bytes(int(bytes_per_s)) + "/s"


def _bar(used: int, capacity: int) -> Text:
    share = min(1.0, used / capacity) if capacity else 0.0
    full = round(share * _BAR_WIDTH)
    style = "red" if share >= 0.95 else "yellow" if share >= 0.8 else "green"
    return Text.assemble(("█" * full, style), ("░" * (_BAR_WIDTH - full), "dim"), f" {render.pct(share):>6}")


def _grid(title: str, rows: Sequence[tuple[str, ...]], headers: tuple[str, ...] = ()) -> Table:
    t = Table(title=title, title_justify="left", show_header=bool(headers), box=None, padding=(0, 2))
    width = len(rows[0]) if rows else len(headers)
    for i in range(width):
        t.add_column(headers[i] if headers else "", style="bold" if i == 0 else None,
                     justify="left" if i == 0 else "right")
    for row in rows:
        t.add_row(*row)
    return t


def render_view(v: TopView, refresh: int, iterations: int | None) -> RenderableType:
    """One frame as rich renderables (user strings go in as `Text`, never as markup)."""
    last = f"last {v.interval_s:.1f}s"
    header = Text.assemble(("kvstore top", "bold"), f"  node {v.node_id}  up {render.human_age(v.uptime_s)}  "
                           f"refresh {refresh}" + (f"/{iterations}" if iterations else "") +
                           f", {last}  (q quits)")
    t, r = v.total, v.recent
    rows = [(name, _share(a, t.lookups), _share(b, r.lookups)) for name, a, b in (
        ("ram", t.ram, r.ram), ("disk", t.disk, r.disk), ("peer", t.peer, r.peer),
        ("all tiers", t.all, r.all))]
    if v.tokens_total is not None and v.tokens_recent is not None:  # the same in tokens, where they are known
        tt, tr = v.tokens_total, v.tokens_recent
        rows.append(("tokens", _share(tt.ram + tt.disk, tt.lookups), _share(tr.ram + tr.disk, tr.lookups)))
    hit = _grid("hit rate", rows, headers=("tier", "total", last))
    tput = _grid(f"throughput ({last})", [
        ("committed", _rate(v.committed_bytes_per_s)), ("read", _rate(v.read_bytes_per_s)),
        ("disk write", _rate(v.disk_write_bytes_per_s)), ("disk read", _rate(v.disk_read_bytes_per_s))])
    side = Table.grid(padding=(0, 6))
    side.add_row(hit, tput)
    occ = Table(title="occupancy", title_justify="left", show_header=False, box=None, padding=(0, 2))
    occ.add_column(style="bold")
    occ.add_column()
    occ.add_column()
    occ.add_row("ram", _bar(v.ram_allocated_bytes, v.ram_capacity_bytes),
                f"{render.human_bytes(v.ram_allocated_bytes)} of {render.human_bytes(v.ram_capacity_bytes)}, "
                f"{v.blocks} blocks")
    if v.disk_capacity_bytes is None:
        occ.add_row("disk", Text("off"), "")
    else:
        occ.add_row("disk", _bar(v.disk_used_bytes or 0, v.disk_capacity_bytes),
                    f"{render.human_bytes(v.disk_used_bytes or 0)} of {render.human_bytes(v.disk_capacity_bytes)}, "
                    f"{v.disk_blocks} blocks")
    activity = Text(f"leases {v.leases_active}   reservations {v.reservations_active}   "
                    f"evictions {v.evictions} ({v.evictions_per_s:.1f}/s)   "
                    f"promotions {v.promotions} ({v.promotions_per_s:.1f}/s)")
    state_style = "bold red" if v.disk_state.startswith("DEGRADED") else None
    disk = Text.assemble(("disk tier: ", "bold"), (v.disk_state, state_style or ""))
    return Group(header, Text(""), side, Text(""), occ, activity, disk, Text(""), _namespaces(v, last))


def _namespaces(v: TopView, last: str) -> RenderableType:
    if not v.namespaces:
        return Text("namespaces: none registered")
    t = Table(title=f"busiest namespaces (by lookups, {last})", title_justify="left")
    for name in ("namespace", "lookups", "hit rate", "lookups total", "hit rate total", "blocks", "bytes"):
        t.add_column(name, justify="left" if name == "namespace" else "right",
                     overflow="fold" if name == "namespace" else "ellipsis", no_wrap=name != "namespace")
    for n in v.namespaces:
        t.add_row(Text(n.name), str(n.lookups), _share(n.hits, n.lookups), str(n.lookups_total),
                  _share(n.hits_total, n.lookups_total), str(n.blocks), render.human_bytes(n.bytes))
    return t


# -- the loop -------------------------------------------------------------------------------------------------
class _Keys:
    """Single key presses from a terminal stdin (cbreak: no Enter needed), and Ctrl-C, as a quit request.

    When stdin is not a terminal it is never read (it may belong to a pipeline). Ctrl-C does not raise while
    top runs: SIGINT only sets `interrupted` and wakes the wait (signal.set_wakeup_fd on a pipe the wait
    selects on), so it never lands inside a Stats call, whose gRPC channel an interrupt can leave unable to
    close (the process then hung instead of exiting). Off the main thread signals stay as they were. The
    terminal's settings and the previous SIGINT handler are restored on exit, whatever ended the loop.
    """

    def __init__(self) -> None:
        self._fd: int | None = None
        self._saved: list[Any] | None = None
        self._wake: tuple[int, int] | None = None
        self._old_wakeup_fd = -1
        self._old_handler: Any = None
        self.interrupted = False

    def __enter__(self) -> _Keys:
        try:
            if sys.stdin is not None and sys.stdin.isatty():
                self._fd = sys.stdin.fileno()
                self._saved = termios.tcgetattr(self._fd)
                tty.setcbreak(self._fd)
        except (OSError, ValueError, termios.error):
            self._fd = None
        if threading.current_thread() is threading.main_thread():
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            self._wake = (r, w)
            self._old_wakeup_fd = signal.set_wakeup_fd(w)
            self._old_handler = signal.signal(signal.SIGINT, self._on_interrupt)
        return self

    def _on_interrupt(self, signum: int, frame: Any) -> None:
        self.interrupted = True

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self._fd is not None and self._saved is not None:
            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)
        if self._wake is not None:
            signal.signal(signal.SIGINT, self._old_handler)
            signal.set_wakeup_fd(self._old_wakeup_fd)
            for fd in self._wake:
                os.close(fd)
            self._wake = None

    def wait_for_quit(self, seconds: float) -> bool:
        """Sleep `seconds`, or less when 'q' is pressed or Ctrl-C comes: True then."""
        deadline = time.monotonic() + seconds
        while not self.interrupted and (left := deadline - time.monotonic()) > 0:
            fds = [fd for fd in (self._fd, self._wake[0] if self._wake else None) if fd is not None]
            if not fds:
                time.sleep(left)
                return False
            ready, _, _ = select.select(fds, [], [], left)
            if self._wake is not None and self._wake[0] in ready:
                os.read(self._wake[0], 512)  # drain: the handler has run (or runs next) and set `interrupted`
            if self._fd is not None and self._fd in ready:
                ch = os.read(self._fd, 1)
                if ch in (b"q", b"Q"):
                    return True
                if not ch:  # the terminal went away: keep refreshing without keys
                    self._fd = None
        return self.interrupted


def run(client: Client, args: argparse.Namespace) -> int:
    """`kvstore top`: frames until --iterations or q / Ctrl-C (both exit 0); --json prints the last frame."""
    interval: float = args.interval
    iterations: int | None = args.iterations
    if args.json:
        prev, t0 = client.stats(), time.monotonic()
        view = None
        for _ in range(iterations or 1):
            time.sleep(interval)
            cur, t1 = client.stats(), time.monotonic()
            view, prev, t0 = build_view(prev, cur, t1 - t0), cur, t1
        assert view is not None
        render.emit_json(view_doc(view))
        return 0
    console = Console(file=sys.stdout, highlight=False)
    waiting = Text(f"kvstore top: sampling {client.address} every {interval:g}s (q quits)")
    try:
        with _Keys() as keys, Live(waiting, console=console, auto_refresh=False) as live:
            prev, t0 = client.stats(), time.monotonic()
            done = 0
            while (iterations is None or done < iterations) and not keys.interrupted:
                if keys.wait_for_quit(interval):
                    break
                cur, t1 = client.stats(), time.monotonic()
                done += 1
                live.update(render_view(build_view(prev, cur, t1 - t0), done, iterations), refresh=True)
                prev, t0 = cur, t1
    except KeyboardInterrupt:  # Ctrl-C is how people leave top: not an error
        pass
    return 0
