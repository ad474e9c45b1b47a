"""GatedIO: a real disk BlockIO whose chosen call waits at a gate, so a test can hold one transfer in flight.

The tests of the disk tier and of the engine's tiering need "a read (or write) is inside the device now" as an
explicit sync point, not a sleep: arm the op, wait for `entered`, do what must race with it, open the gate.

    io = GatedIO()
    store = DiskStore(config, io=io)
    io.armed = "pread"                  # every pread from now on waits at the gate
    ...start the operation in a thread...
    assert io.entered.wait(10)          # one pread is in flight
    ...delete / close / evict while it is held...
    io.gate.set()                       # it (and every later one) goes through

It is a FaultyIO (kvstore/tiers/disk/io.py), so the same double can also inject errors (`io.inject(...)`);
with no rules it behaves as the plain BlockIO.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvstore.tiers.disk import FaultyIO
from kvstore.transfers import TransferMeter

__all__ = ["GatedIO", "FaultyIO"]


class GatedIO(FaultyIO):
    """A FaultyIO whose pread or pwrite, once `armed` with that op's name, waits until `gate` is set.

    `armed`: "" (nothing held), "pread" or "pwrite". `entered` is set when an armed call reaches the gate.
    A call that waits longer than `wait_s` fails the test with an AssertionError (the test never opened it)."""

    def __init__(self, *, wait_s: float = 20.0, direct: bool = True, transfers: TransferMeter | None = None) -> None:
        super().__init__(direct=direct, transfers=transfers)
        self.armed = ""
        self.entered = threading.Event()
        self.gate = threading.Event()
        self._wait_s = wait_s

    def _hold(self, op: str, during: Callable[[], None] | None) -> Callable[[], None] | None:
        """Wait at the gate if `op` is armed. A held call is in flight from the gate on, so the work meant to
        overlap it (a promoter's verification of the block it read before) runs first: the gate holds this
        transfer only, as a slow device would. Returns the work still to pass on."""
        if self.armed != op:
            return during
        if during is not None:
            during()
        self.entered.set()
        assert self.gate.wait(self._wait_s), f"the test never opened the gate held by a {op}"
        return None

    def pread(self, fd: int, address: int, length: int, offset: int,
              during: Callable[[], None] | None = None) -> int:
        return super().pread(fd, address, length, offset, self._hold("pread", during))

    def pwrite(self, fd: int, address: int, length: int, offset: int,
               during: Callable[[], None] | None = None) -> None:
        super().pwrite(fd, address, length, offset, self._hold("pwrite", during))
