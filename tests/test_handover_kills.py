"""A hand-over interrupted at every step by kill -9 of either side: afterwards exactly one daemon serves, and every
block it serves is the stored bytes.

The side under test is held at a named step (kvstore/server/handover/holds.py: it writes the step to a file and
waits there), the test sees the file and kills it with SIGKILL. Then:
- the successor killed at any step before the commit: the running daemon never stopped serving, or resumes
  (its disk tier reopened, its listener accepting again) and keeps every RAM block;
- the running daemon killed before it handed anything over: the successor starts cold (the disk tier keeps
  what it had); killed after the offer: the successor serves the arena it was handed, every block verified
  again as after a crash (a new incarnation); killed after FROZEN: the successor serves everything.
"""

from __future__ import annotations

import signal
import subprocess

import pytest

from kvstore import Client
from kvstore.testing import DaemonProcess, wait_until

NS = "m@1/kills"
BLOCK = 32 * 1024
N = 40


def _values() -> tuple[list[bytes], list[bytes]]:
    keys = [b"k-%03d" % i for i in range(N)]
    return keys, [bytes([i + 1]) * BLOCK for i in range(N)]


def _start_with_blocks(tmp_path, env: dict[str, str] | None = None) -> DaemonProcess:
    d = DaemonProcess(workdir=str(tmp_path), arena_bytes="32MiB", max_block_bytes="1MiB", disk_bytes="128MiB",
                      disk_segment_bytes="16MiB", handover_timeout_s=20, env=env,
                      disk_write="commit")  # write-behind: the disk holds every block before the hand-over
    d.start()
    keys, values = _values()
    try:
        with d.client() as c:
            c.register_namespace(NS)
            assert c.put_many(NS, keys, values).stored == N
            wait_until(lambda: c.stats().disk.blocks == N, 30, what="disk writes")
    except BaseException:  # the caller's finally never sees a daemon this failed to return: stop it here
        d.close()
        raise
    return d


def _hold(side: str, step: str, tmp_path) -> dict[str, str]:
    return {"KVSTORE_HANDOVER_HOLD": f"{side}:{step}", "KVSTORE_HANDOVER_HOLD_FILE": str(tmp_path / "held")}


def _held(d: DaemonProcess, side: str, step: str, tmp_path) -> DaemonProcess:
    """A successor started beside `d`, once the side told to hold (by its environment) waits at `step`."""
    hold = tmp_path / "held"
    s = d.successor(env=_hold(side, step, tmp_path) if side == "receiver" else None, wait=False)
    wait_until(lambda: hold.exists() and hold.read_text() == step, 60, what=f"{side} held at {step}")
    return s


def _serves_exactly(address: str, ram: bool) -> int:
    """Every block is served with its bytes; returns the pid serving. `ram`: all from RAM (else disk is fine)."""
    keys, values = _values()
    with Client(address, timeout_s=20) as c:
        assert c.get_many(NS, keys) == values
        if ram:
            assert c.probe_prefix(NS, keys) == (N, True)
        assert c.put(NS, b"after", b"x" * BLOCK) in (True, False)
        return c.health().pid


def _reap(p: subprocess.Popen | None) -> None:
    if p is not None and p.poll() is None:
        p.kill()
        p.wait()


@pytest.mark.parametrize("step", ["offered", "accepted", "verified", "frozen", "adopted"])
def test_successor_killed_at_a_step_leaves_the_old_daemon_serving(step: str, tmp_path) -> None:
    d = _start_with_blocks(tmp_path)
    s = _held(d, "receiver", step, tmp_path)
    try:
        assert s.proc is not None and d.proc is not None
        s.proc.kill()
        s.proc.wait()
        pid = _serves_exactly(d.address, ram=True)
        assert pid == d.proc.pid and d.proc.poll() is None
        if step in ("frozen", "adopted"):
            wait_until(lambda: "serving again" in d.log(), 20, what="the old daemon resuming")
            # and a later hand-over still works: nothing of the failed one is left in the way
            s2 = d.successor()
            assert _serves_exactly(d.address, ram=True) == s2.proc.pid  # type: ignore[union-attr]
            s2.close()
    finally:
        _reap(s.proc)
        d.close()


@pytest.mark.parametrize("step,ram", [("authenticated", False), ("offered", False), ("prepared", True),
                                      ("frozen", True), ("sent", True), ("committed", True)])
def test_old_daemon_killed_at_a_step_leaves_the_successor_serving(step: str, ram: bool, tmp_path) -> None:
    d = _start_with_blocks(tmp_path, env=_hold("sender", step, tmp_path))
    s = _held(d, "sender", step, tmp_path)
    try:
        assert d.proc is not None and s.proc is not None
        d.proc.kill()
        d.proc.wait()
        s._wait_ready(60)  # noqa: SLF001 - the successor alone answers now
        assert _serves_exactly(d.address, ram=ram) == s.proc.pid
        log = s.log()
        if step in ("sent", "committed"):
            assert "keep their mappings (same incarnation)" in log
        elif ram:
            assert "died mid-way" in log and "remap once (new incarnation)" in log
        elif step == "authenticated":  # nothing came: cold, the disk tier brings the blocks back
            assert "died before handing anything over" in log
        else:  # the arena came, but no block of it could be checked yet (no prepare): the disk tier again
            assert "died mid-way" in log
    finally:
        _reap(d.proc)
        s.close()
        d.close()


def test_successor_killed_after_the_commit_is_a_crash_of_the_serving_daemon(tmp_path) -> None:
    # past COMMIT the old daemon never serves again (it cannot know what the successor changed): the node
    # is down until restarted, and then the disk tier holds every block
    d = _start_with_blocks(tmp_path)
    s = _held(d, "receiver", "committed", tmp_path)
    try:
        assert s.proc is not None and d.proc is not None
        s.proc.kill()
        s.proc.wait()
        wait_until(lambda: d.proc is not None and d.proc.poll() is not None, 30, what="the old daemon's exit")
        fresh = DaemonProcess.__new__(DaemonProcess)
        fresh.__dict__.update(d.__dict__)
        fresh._tmp = None
        fresh.log_path = str(tmp_path / "fresh.log")
        fresh.args = [a for a in d.args if a != "--take-over"]
        fresh.start()
        assert _serves_exactly(d.address, ram=False) == fresh.proc.pid  # type: ignore[union-attr]
        fresh.stop(signal.SIGTERM)
    finally:
        _reap(s.proc)
        d.close()
