"""Degraded state of the disk tier and its log lines: ONE error when the store degrades, one line when it recovers.

A write fault (data pwrite, fdatasync, preallocation, index commit) degrades the store: write_many then answers
DEGRADED without touching the disk, so a dead or full disk costs the engine one status per batch instead of a
log storm and a stalled writer. Reads continue (they fail on their own if they must). The owner calls probe()
every `probe_interval_s`; the first probe that writes, syncs and reads back clears the state.
"""

from __future__ import annotations

import errno
import logging

from kvstore.tiers.disk.types import DiskStatus

__all__ = ["Health", "status_for", "advice_for"]

log = logging.getLogger("kvstore.tiers.disk")

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def status_for(exc: OSError) -> DiskStatus:
    return DiskStatus.NO_SPACE if exc.errno in _NO_SPACE else DiskStatus.IO_ERROR


def advice_for(exc: OSError) -> str:
    if exc.errno in _NO_SPACE:
        return "free space on that filesystem (or lower disk capacity_bytes so the segments fit)"
    if exc.errno == errno.EROFS:
        return "the filesystem is read-only (often remounted after device errors): check dmesg, then remount it rw"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "the daemon lost write permission: fix the owner/mode of the directory and its files"
    return "the device reports errors: check dmesg and the disk's health, or move the directory to another disk"


def describe(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "error")
    return f"{exc.strerror or exc} ({name})"


class Health:
    """Degraded flag + reason. Not thread-safe by itself: the store calls it under its state lock."""

    def __init__(self, directory: str, probe_interval_s: float) -> None:
        self.directory = directory
        self.probe_interval_s = probe_interval_s
        self.degraded = False
        self.reason = ""
        self.status = DiskStatus.OK          # NO_SPACE or IO_ERROR while degraded
        self._read_errors_logged = False

    def fault(self, op: str, exc: OSError) -> DiskStatus:
        """Record a write-side fault; logs only on the change OK -> degraded. Returns NO_SPACE or IO_ERROR."""
        status = status_for(exc)
        reason = f"{op} failed: {describe(exc)}"
        if not self.degraded:
            log.error(
                "disk tier at %s is DEGRADED: %s. Writes to disk are refused (reads continue) and retried every "
                "%gs. What to do: %s.",
                self.directory, reason, self.probe_interval_s, advice_for(exc),
            )
        self.degraded, self.reason, self.status = True, reason, status
        return status

    def read_only(self, exc: OSError) -> None:
        """The store was opened on a filesystem that refuses writes: serve reads, refuse writes."""
        self.fault("opening for writing", exc)

    def recovered(self) -> None:
        if self.degraded:
            log.warning("disk tier at %s recovered (was: %s); writes to disk resume", self.directory, self.reason)
        self.degraded, self.reason, self.status = False, "", DiskStatus.OK
        self._read_errors_logged = False

    def read_fault(self, what: str, exc: OSError | None = None) -> None:
        """A failed block read: logged once until the next recovery (counters carry the rest)."""
        if self._read_errors_logged:
            return
        self._read_errors_logged = True
        detail = describe(exc) if exc is not None else "bad bytes"
        log.error(
            "disk tier at %s: %s (%s); the entry was dropped and the block counts as a miss. Further read errors "
            "are only counted (stats: io_errors, checksum_failures); check dmesg and the disk's health",
            self.directory, what, detail,
        )
