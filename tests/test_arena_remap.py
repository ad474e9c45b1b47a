"""A mapping outlives every copy that uses it: remaps, close() and kill -9 restarts under running copies.

Before arena mappings were reference-counted, a thread copying with get_many_into while another thread
remapped (a daemon restart) segfaulted the process (exit -11). Both stress runs below are separate processes
(tests/remap_stress.py), so a crash shows as its exit status.
"""

from __future__ import annotations

import pytest

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvstore.arena.layout import ArenaLayout
from kvstore.client.arena_map import ArenaMap
from kvstore.testing import DaemonProcess

pytestmark = pytest.mark.usefixtures("control_path")  # every test over the fast path and over gRPC

STRESS = Path(__file__).with_name("remap_stress.py")
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}


def _run(mode: str, address: str, seconds: float, stop_file: str = "") -> subprocess.Popen[str]:
    extra = ["--stop-file", stop_file] if stop_file else []
    return subprocess.Popen([sys.executable, str(STRESS), mode, address, "--seconds", str(seconds), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def _finish(p: subprocess.Popen[str]) -> dict[str, int]:
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, f"exit {p.returncode}\n{err[-3000:]}"
    global _LAST_STDERR
    _LAST_STDERR = err[-4000:]  # the stress process's log, shown when a count below is off
    return json.loads(out.strip().splitlines()[-1])


_LAST_STDERR = ""


def test_remaps_and_close_under_concurrent_copies_never_crash_or_return_wrong_bytes() -> None:
    with DaemonProcess(arena_bytes="32MiB", max_block_bytes="1MiB") as d:
        counts = _finish(_run("client", d.address, 4.0))
    assert counts["wrong"] == 0
    assert counts["remaps"] >= 50, counts            # many mappings were replaced under the readers
    assert counts["exact"] >= 16 * 10, counts        # and reads kept landing exactly between remaps


def test_connector_loads_through_kill_9_restarts_are_exact_or_reported_failed(tmp_path: Path) -> None:
    d = DaemonProcess(workdir=str(tmp_path), arena_bytes="32MiB", max_block_bytes="1MiB")
    d.start()
    stop = tmp_path / "stop"
    try:
        # the loop runs until the test says stop (120 s at most): a daemon's start under load takes seconds, and
        # the last restart must be followed by loads, whatever the machine's pace
        p = _run("connector", d.address, 120.0, str(stop))
        time.sleep(2.0)
        kills = 0
        for _ in range(4):                            # four kill -9 / restart cycles under the copy loop
            d.stop(signal.SIGKILL)
            kills += 1
            time.sleep(0.5)
            d.start()
            time.sleep(2.0)
        stop.write_text("stop")
        counts = _finish(p)
    finally:
        d.close()
    assert kills == 4
    assert counts["wrong"] == 0
    assert counts["loads_ok"] + counts["loads_failed"] == counts["iterations"]
    assert counts["iterations"] >= 150, counts        # hundreds of save + load rounds across the restarts (300
    assert counts["loads_ok"] >= 50, (counts, _LAST_STDERR)  # on a quiet box), many of them exact loads
    assert counts["loads_failed"] >= 4, counts        # every restart was felt: loads failed (vLLM recomputes)
    assert counts["ok_streak_at_end"] >= 10, counts   # and after the last restart the connector came back


def test_retired_mapping_is_unmapped_only_after_its_last_reference(tmp_path: Path) -> None:
    """ArenaMap's contract with exact states: retire() under two references unmaps at the second release,
    runs close hooks first, and refuses new references meanwhile."""
    layout = ArenaLayout("t", 2, 1 << 20)
    fd = os.memfd_create("t")
    os.ftruncate(fd, layout.size_bytes)
    m = ArenaMap(fd, layout, incarnation=5, isolated=False)
    events: list[str] = []
    m.on_close(lambda: events.append(f"hook refs={m.references}"))
    assert m.acquire() and m.acquire() and m.references == 2
    view = np.frombuffer((np.ctypeslib.as_ctypes_type(np.uint8) * 8).from_address(m.address + layout.data_offset),
                         dtype=np.uint8)
    view[:] = 7
    m.retire()
    assert not m.acquire() and not m.closed and events == []
    m.release()
    assert not m.closed and int(view.sum()) == 56     # still mapped: one copy still holds it
    m.release()
    assert m.closed and events == ["hook refs=0"]
    late: list[str] = []
    m.on_close(lambda: late.append("ran"))            # registered after the close: runs at once
    assert late == ["ran"]
