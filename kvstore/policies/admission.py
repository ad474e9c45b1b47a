"""Disk admission: which RAM blocks deserve a copy on the SSD.

Every admitted block costs one write of its size to flash. `always` gives the best hit rate and warm restarts;
`seen:N` admits a block only once it has been put or hit N times in RAM, sparing SSD endurance from blocks
that are used once (the one-hit wonders that dominate some traces). Like the eviction policies, an admission
policy only decides: the engine calls it under its lock with the block's saturating use count.
"""

from __future__ import annotations

import abc
import re

from kvstore.errors import ConfigError

__all__ = ["AdmissionPolicy", "AlwaysAdmit", "SeenNTimes", "make_admission", "ADMISSION_HELP"]

ADMISSION_HELP = "always | seen:N (admit once a block was put or hit N times, N in 1..255) | never"


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
