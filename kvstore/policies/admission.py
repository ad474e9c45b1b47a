"""Disk admission: which RAM blocks deserve a copy on the SSD, and when that copy is written.

Every admitted block costs one write of its size to flash. `always` gives the best hit rate and warm restarts;
`seen:N` admits a block only once it has been put or hit N times in RAM, sparing SSD endurance from blocks
that are used once (the one-hit wonders that dominate some traces). Like the eviction policies, an admission
policy only decides: the engine calls it under its lock with the block's saturating use count.

When (`disk_write`, WRITE_MODES): `commit` writes an admitted block soon after its commit (write-behind: the
disk holds a copy of most of RAM, and a crash loses only what the writer had not reached); `evict` writes it
when RAM evicts it, before its slot is freed (the disk holds what RAM let go of, so RAM and disk hold mostly
different blocks, at the cost of losing RAM-only blocks in a crash). The admission policy says
which blocks may be written, the mode when it is asked; kvstore/engine/disk_link.py does both.
"""

from __future__ import annotations

import abc
import re

from kvstore.errors import ConfigError

__all__ = ["AdmissionPolicy", "AlwaysAdmit", "SeenNTimes", "make_admission", "ADMISSION_HELP", "WRITE_MODES",
           "WRITE_HELP", "check_write_mode"]

ADMISSION_HELP = "always | seen:N (admit once a block was put or hit N times, N in 1..255) | never"
WRITE_MODES = ("commit", "evict")
WRITE_HELP = ("when an admitted block is written: evict (when RAM evicts it, before its slot is freed; a block "
              "read back from disk keeps its copy) | commit (soon after its commit: write-behind)")


def check_write_mode(mode: str) -> str:
    """`mode` when it names a write mode; ConfigError listing them otherwise."""
    if mode not in WRITE_MODES:
        raise ConfigError(f"invalid config: disk_write={mode!r}: use {' or '.join(WRITE_MODES)} ({WRITE_HELP})")
    return mode


class AdmissionPolicy(abc.ABC):
    name: str
    #: the smallest use count that admits; the engine checks `seen >= threshold` vectorized on the hot path
    threshold: int

    def admits(self, seen: int) -> bool:
        return seen >= self.threshold


class AlwaysAdmit(AdmissionPolicy):
    name = "always"
    threshold = 1


class NeverAdmit(AdmissionPolicy):
    """The disk tier is read-only for new blocks (e.g. while an operator drains a node)."""

    name = "never"
    threshold = 256  # above the saturating uint8 counter: never reached


class SeenNTimes(AdmissionPolicy):
    def __init__(self, n: int) -> None:
        if not 1 <= n <= 255:
            raise ConfigError(f"disk_admission seen:{n}: N must be 1..255")
        self.threshold = n
        self.name = f"seen:{n}"


def make_admission(spec: str) -> AdmissionPolicy:
    if spec == "always":
        return AlwaysAdmit()
    if spec == "never":
        return NeverAdmit()
    m = re.fullmatch(r"seen:(\d+)", spec)
    if m:
        return SeenNTimes(int(m.group(1)))
    raise ConfigError(f"disk_admission={spec!r}: use {ADMISSION_HELP}")
