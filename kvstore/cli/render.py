"""Everything the CLI prints: rich tables for people, one JSON document for scripts, and the key/size/age formats.

Kept apart from the commands so each command only decides *what* to report; how it looks (and that --json
always yields exactly one parseable document on stdout) is settled here once. User-supplied strings (keys,
namespace names) go into `Text` objects so that a key like "[bold]" is shown, never interpreted as markup.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterable
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvstore.client.reports import DiskWriteBudgetStats
from kvstore.client.types import ControlPlaneStats, Health, KeyInfo, PeerTierStats, Stats

__all__ = [
    "HEX_PREFIX", "human_bytes", "human_age", "pct", "key_text", "key_label", "key_doc", "key_info_doc", "stats_doc",
    "emit_json", "say", "warn", "print_stats", "print_keys", "print_key", "print_health",
]

HEX_PREFIX = "hex:"
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def _console() -> Console:
    """A fresh console per call so it writes to the *current* sys.stdout (pytest's capsys swaps it)."""
    return Console(file=sys.stdout, highlight=False)


def human_bytes(n: int) -> str:
    """Binary units because arena and block sizes are configured in KiB/MiB/GiB."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_age(seconds: float) -> str:
    """Two significant units at most: enough to tell a fresh block from a stale one at a glance."""
    s = max(0.0, seconds)
    if s < 60:
        return f"{s:.1f}s"
    m, s = divmod(int(s), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def pct(x: float) -> str:
    """A share as a percentage with one decimal: the one format of hit rates and occupancy (top, stats)."""
    return _pct(x)


def key_text(key: bytes) -> str | None:
    """The key as text when it is printable UTF-8, else None (so binary hashes never garble a terminal)."""
    try:
        text = key.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if text.isprintable() and text else None


def key_label(key: bytes) -> str:
    """The key in the CLI's own input syntax, so what `ls` prints can be pasted into `get`/`show`/`delete`."""
    text = key_text(key)
    if text is not None and not text.startswith(HEX_PREFIX):
        return text
    return HEX_PREFIX + key.hex()


def key_doc(key: bytes) -> dict[str, Any]:
    return {"key": key.hex(), "key_text": key_text(key)}


def key_info_doc(info: KeyInfo) -> dict[str, Any]:
    return {**key_doc(info.key), "size": info.size, "tier": info.tier, "age_s": round(info.age_s, 3),
            "pins": info.pins, "leases": info.leases, "checksum": info.checksum, "tokens": info.tokens or None}


def stats_doc(stats: Stats) -> dict[str, Any]:
    doc = dataclasses.asdict(stats)
    doc["counters"] = dict(sorted(stats.counters.items()))  # a protobuf map has no stable order
    for ns_doc, ns in zip(doc["namespaces"], stats.namespaces):
        ns_doc["hit_rate"] = ns.hit_rate
        ns_doc["lookup_tokens"], ns_doc["hit_tokens"] = ns.lookup_tokens, ns.hit_tokens  # null: tokens unknown
    return doc


def _tenants_table(s: Stats) -> Table:
    """Usage against quotas, one row per tenant ('-': no quota)."""
    t = Table(title="tenants", title_justify="left")
    for name in ("tenant", "ram", "ram quota", "disk", "disk quota"):
        t.add_column(name, justify="left" if name == "tenant" else "right")
    for r in s.tenants:
        t.add_row(Text(r.tenant or "(none)"), human_bytes(r.ram_bytes),
                  human_bytes(r.ram_quota_bytes) if r.ram_quota_bytes else "-", human_bytes(r.disk_bytes),
                  human_bytes(r.disk_quota_bytes) if r.disk_quota_bytes else "-")
    return t


def emit_json(doc: object) -> None:
    """The one JSON document of a --json run (plain print: rich would wrap long lines and break parsing)."""
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    sys.stdout.flush()


def say(message: str) -> None:
    """A one-line human result (plain text: these lines are often grepped)."""
    print(message, file=sys.stdout)


def warn(message: str) -> None:
    print(f"kvstore: {message}", file=sys.stderr)


def _kv_table(title: str, rows: Iterable[tuple[str, object]]) -> Table:
    t = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 2))
    t.add_column("field", style="bold")
    t.add_column("value", overflow="fold")
    for name, value in rows:
        t.add_row(name, value if isinstance(value, Text) else Text(str(value)))
    return t


def _control_line(c: ControlPlaneStats | None) -> str:
    if c is None or not c.socket:
        return "none (no unix_socket: local clients stream over gRPC)"
    return (f"{c.socket}: {c.fast_connections} fast-path connection(s), {c.fast_requests} requests, "
            f"{c.arena_files_handed} arena files handed, {c.fast_refused} refused, {c.fast_frame_errors} bad frames")


def print_stats(s: Stats) -> None:
    c = _console()
    cap = s.capacity_bytes or 1
    locked = "locked (mlock)" if s.arena_locked else "NOT locked (may be swapped out)"
    c.print(_kv_table(f"kvstore node {s.node_id}", [
        ("policy", s.policy),
        ("uptime", human_age(s.uptime_s)),
        ("arena", f"{s.arena_name}, {locked}"),
        ("same-node socket", _control_line(s.control)),
        ("capacity", f"{human_bytes(s.capacity_bytes)} ({s.slabs_total} slabs of {human_bytes(s.slab_bytes)}, "
                     f"{s.slabs_free} free)"),
        ("allocated", f"{human_bytes(s.allocated_bytes)} ({_pct(s.allocated_bytes / cap)}; evicts above "
                      f"{_pct(s.high_watermark)} down to {_pct(s.low_watermark)})"),
        ("stored", human_bytes(s.stored_bytes)),
        ("reserved", human_bytes(s.reserved_bytes)),
        ("leased", human_bytes(s.leased_bytes)),
        ("pinned", human_bytes(s.pinned_bytes)),
        ("slot waste", f"{_pct(s.fragmentation)} of allocated (payload smaller than its size class)"),
        ("stranded", f"{human_bytes(s.stranded_bytes)} (free slots held by a size class)"),
        ("blocks", s.blocks),
        ("leases active", s.leases_active),
        ("reservations active", s.reservations_active),
    ]))
    d = s.disk
    if d is not None:
        state = f"DEGRADED: {d.degraded_reason}" if d.degraded else "healthy"
        c.print(_kv_table("disk tier", [
            ("directory", d.directory),
            ("state", state),
            ("used", f"{human_bytes(d.used_bytes)} of {human_bytes(d.capacity_bytes)} "
                     f"({d.segments_total - d.segments_free}/{d.segments_total} segments)"),
            ("blocks", d.blocks),
            ("compression", f"{d.compression_ratio:.2f}x ({human_bytes(d.raw_bytes)} -> {human_bytes(d.stored_bytes)})"),
            ("written / read", f"{human_bytes(d.bytes_written)} / {human_bytes(d.bytes_read)}"),
            ("writes", f"disk_write {d.write_mode or '?'}, admission {d.admission}"),
            ("write queue", f"{d.write_queue_blocks} blocks ({d.writeback_blocks} RAM victims being written back); "
                            f"promotions in flight {d.promotion_queue_blocks}"),
            *_budget_rows(d.budget),
            ("evicted", f"{d.evicted_blocks} blocks, {human_bytes(d.evicted_bytes)}"),
            ("checksum failures / io errors", f"{d.checksum_failures} / {d.io_errors}"),
        ]))
    else:
        c.print(Text("disk tier: off"))
    p = s.peers
    if p is not None:
        c.print(_kv_table("peer tier", [("members", _peers_line(p)), ("pending pushes", p.pending_pushes),
                                         ("pending hand-offs", p.pending_handoffs),
                                         ("settled", _settled_line(p))]
                          + [(k.replace("_", " "), v) for k, v in p.counters.items()]))
    counters = Table(title="counters", title_justify="left", show_header=False, box=None, padding=(0, 2))
    for _ in range(2):
        counters.add_column(style="bold")
        counters.add_column(justify="right")
    items = sorted(s.counters.items())
    half = (len(items) + 1) // 2
    for left, right in zip(items[:half], items[half:] + [("", "")]):
        counters.add_row(left[0], str(left[1]), right[0], str(right[1]))
    c.print(counters)
    ns = Table(title="namespaces", title_justify="left")
    disk = s.disk is not None
    for name, justify in (("namespace", "left"), ("model", "left"), ("blocks", "right"), ("bytes", "right"),
                          *((("on disk", "right"),) if disk else ()), ("hit rate", "right"), ("puts", "right")):
        ns.add_column(name, justify=justify, overflow="fold")
    for n in s.namespaces:
        ns.add_row(Text(n.name), Text(n.model or "-"), str(n.blocks), human_bytes(n.bytes),
                   *((human_bytes(n.disk_bytes),) if disk else ()),
                   _pct(n.hit_rate) if n.lookup_keys else "-", str(n.puts))
    c.print(ns if s.namespaces else Text("namespaces: none registered"))
    if any(t.ram_quota_bytes or t.disk_quota_bytes for t in s.tenants) or len(s.tenants) > 1:
        c.print(_tenants_table(s))
    sc = Table(title="size classes", title_justify="left")
    for name in ("slot", "slabs", "used slots", "free slots"):
        sc.add_column(name, justify="right")
    for cls in s.size_classes:
        sc.add_row(human_bytes(cls.slot_bytes), str(cls.slabs), str(cls.used_slots), str(cls.free_slots))
    c.print(sc)


def print_keys(namespace: str, infos: list[KeyInfo], truncated: bool) -> None:
    c = _console()
    t = Table(title=Text(f"{namespace}: {len(infos)} key(s)" + (" (more not shown; raise --limit)" if truncated
                                                                 else "")), title_justify="left")
    t.add_column("key (hex)", overflow="fold")
    t.add_column("text", overflow="fold")
    for name in ("tier", "size", "age", "pins", "leases"):
        t.add_column(name, justify="left" if name == "tier" else "right", no_wrap=True)
    for k in infos:
        t.add_row(k.key.hex(), Text(key_text(k.key) or ""), k.tier, human_bytes(k.size), human_age(k.age_s),
                  str(k.pins), str(k.leases))
    c.print(t)


def print_key(namespace: str, info: KeyInfo) -> None:
    text = key_text(info.key)
    _console().print(_kv_table(f"{namespace} / {key_label(info.key)}", [
        ("namespace", Text(namespace)),
        ("key (hex)", info.key.hex()),
        ("key (text)", Text(text) if text is not None else "-"),
        ("tier", info.tier),
        ("size", f"{human_bytes(info.size)} ({info.size} bytes)"),
        ("age", human_age(info.age_s)),
        ("pins", info.pins),
        ("leases", info.leases),
        ("checksum", f"{info.checksum:#018x}"),
    ]))


def print_health(h: Health) -> None:
    _console().print(_kv_table(f"kvstore node {h.node_id}", [
        ("status", h.status + (f" ({h.detail})" if h.detail else "")),
        ("version", h.version),
        ("host", f"{h.hostname} (pid {h.pid})"),
        ("uptime", human_age(h.uptime_s)),
        ("arena", f"{h.arena_name}, {human_bytes(h.arena_bytes)}, "
                  f"{'locked' if h.arena_locked else 'NOT locked'}, "
                  f"{'one memory file per tenant' if h.arena_isolated else 'one shared memory file'}"),
        ("this client", f"control {'fast path (same-node socket)' if h.client_control == 'fast' else 'gRPC'}, "
                        f"data {'arena (shared memory)' if h.client_data == 'arena' else 'streamed over gRPC'}, "
                        f"probes {'through the shared key index' if h.client_probe == 'index' else 'by the daemon'}"),
        ("max block", human_bytes(h.max_block_bytes)),
        ("max batch", f"{h.max_batch_keys} keys"),
        ("peers", _peers_line(h.peers)),
    ]))


def _peers_line(p: PeerTierStats | None) -> str:
    if p is None:
        return "off (alone: no etcd_endpoints)"
    etcd = "etcd connected" if p.etcd_connected else "etcd UNREACHABLE (last member set)"
    names = ", ".join(m.node_id + ("*" if m.is_self else "") for m in p.members)
    return f"{len(p.members)} members [{names}], {etcd}, plane {p.data_plane} {p.data_address}, replication {p.replication}"


def _settled_line(p: PeerTierStats) -> str:
    """Whether reads still ask previous owners after a member change."""
    if p.settled:
        return "yes: reads ask each block's owners only"
    return "no: a hand-off is under way somewhere; reads also ask previous owners"


def _budget_rows(b: DiskWriteBudgetStats | None) -> list[tuple[str, object]]:
    """The disk write budget's lines of `kvstore stats` (none without a budget)."""
    if b is None:
        return [("write budget", "none")]
    return [("write budget", f"{human_bytes(b.bytes_per_s)}/s over {b.window_s:g} s; this window "
                             f"{human_bytes(b.window_admitted)} of {human_bytes(b.window_target)}, "
                             f"admit probability {b.probability:.3f}"),
            ("budget admitted / refused", f"{human_bytes(b.admitted_bytes)} ({b.admitted_blocks} blocks) / "
                                          f"{human_bytes(b.refused_bytes)} ({b.refused_blocks} blocks)")]
