"""The one log line a restart that kept the RAM tier writes: what was adopted, what was dropped and why."""

from __future__ import annotations

import logging

from kvstore.arena.verify import Verification
from kvstore.engine.adoption import AdoptReport

__all__ = ["log_adoption"]

log = logging.getLogger("kvstore.server")


def log_adoption(source: str, report: AdoptReport, v: Verification, bad_namespaces: int, lost: set[int],
                 sessions: int, seconds: float, kept_incarnation: bool) -> None:
    dropped = dict(v.dropped)
    for reason, n in report.dropped.items():
        dropped[reason] = dropped.get(reason, 0) + n
    log.info("RAM tier kept from the %s: %d blocks (%d bytes) adopted in %.3fs (%d hashed now: %d bytes), %d "
             "leases, %d reservations, %d sessions, %d disk writes queued; dropped: %s%s; clients %s",
             source, report.blocks, report.bytes, seconds, v.hashed_blocks, v.hashed_bytes, report.leases,
             report.reservations, sessions, report.queued_writes,
             ", ".join(f"{k} {n}" for k, n in sorted(dropped.items())) or "none",
             f" ({bad_namespaces} namespace records damaged, {len(lost)} namespaces lost)" if bad_namespaces or lost
             else "", "keep their mappings (same incarnation)" if kept_incarnation else "remap once (new incarnation)")
