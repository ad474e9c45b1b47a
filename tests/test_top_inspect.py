"""`kvstore top` and `kvstore inspect` against real daemons, after scripted workloads with known outcomes.

top runs in a real pseudo-terminal (pexpect), as a person would run it, and the test reads the last frame it
drew; q, Ctrl-C and --iterations must all end it with exit 0 and the terminal restored. The interval
arithmetic is checked exactly through `build_view` on two real snapshots taken around a workload.

The top workload (arena of 16 x 1 MiB blocks, watermarks 1.0, disk tier of 64 MiB):
  namespace top/a: 20 puts of 1 MiB (each batch of 4 written to disk before the next) -> 16 in RAM, 20 on disk,
    4 evictions; get 3 RAM keys (3 RAM hits), 1 evicted key (1 disk hit, 1 promotion, 1 more eviction) and
    1 absent key -> 5 lookups, 4 hits.
  namespace top/b: 7 lookups of absent keys -> 0 hits.
  In all: 12 lookups; ram 3/12 = 25.0 %, disk 1/12 = 8.3 %, all tiers 4/12 = 33.3 %.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import pexpect
import pytest
from rich.console import Console

from kvstore.cli import render
from kvstore.cli.main import main
from kvstore.cli.top import Hits, build_view, render_view
from kvstore.client.types import NamespaceInfo
from kvstore.testing import DaemonProcess, wait_until

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r")


def _disk_daemon(tmp: Path, **extra: object) -> DaemonProcess:
    opts: dict[str, object] = dict(arena_bytes="16MiB", max_block_bytes="1MiB", high_watermark=1.0,
                                   low_watermark=1.0, disk_bytes="64MiB", disk_segment_bytes="4MiB",
                                   disk_dir=str(tmp / "disk"), disk_sync="none", disk_write="commit")
    opts.update(extra)
    return DaemonProcess(**opts)


def _drain(c) -> None:
    wait_until(lambda: c.stats().disk.write_queue_blocks == 0, timeout_s=30, what="disk writes")


@pytest.fixture(scope="module")
def busy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A daemon after the workload of the module docstring; tests on it only read (Stats, Describe)."""
    with _disk_daemon(tmp_path_factory.mktemp("top")) as d:
        with d.client() as c:
            c.register_namespace("top/a")
            c.register_namespace("top/b")
            keys = [b"m%02d" % i for i in range(20)]
            for i in range(0, 20, 4):
                assert c.put_many("top/a", keys[i:i + 4], [bytes([i]) * MIB] * 4).stored == 4
                _drain(c)
            assert all(v is not None for v in c.get_many("top/a", keys[-3:]))  # 3 RAM hits
            assert c.get("top/a", keys[0]) == bytes([0]) * MIB  # 1 disk hit
            assert c.get("top/a", b"absent") is None
            assert c.get_many("top/b", [b"x%d" % i for i in range(7)]) == [None] * 7
            s = c.stats()
            assert (s.counters["lookup_keys"], s.counters["hit_keys_ram"], s.counters["hit_keys_disk"]) == (12, 3, 1)
        yield d


def _spawn(d: DaemonProcess, *top_args: str, shell_after: str = "") -> pexpect.spawn:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["TERM"] = "xterm-256color"
    argv = [sys.executable, "-m", "kvstore.cli.main", "--address", d.address, "top", *top_args]
    if shell_after:  # run something in the same terminal after top exits (e.g. `stty -a`)
        return pexpect.spawn("/bin/sh", ["-c", shlex.join(argv) + "; " + shell_after], dimensions=(40, 160),
                             env=env, cwd=str(REPO), encoding="utf-8", timeout=30)
    return pexpect.spawn(sys.executable, argv[1:], dimensions=(40, 160), env=env, cwd=str(REPO), encoding="utf-8",
                         timeout=30)


def _last_frame(raw: str, marker: str) -> str:
    """The text of the last frame top drew: everything after its last header, escapes removed."""
    text = _ANSI.sub("", raw)
    assert marker in text, text[-3000:]
    return text[text.rindex(marker):]


def _line(frame: str, pattern: str) -> str:
    for line in frame.splitlines():
        if re.search(pattern, line):
            return line
    raise AssertionError(f"no line matches {pattern!r} in:\n{frame}")


def test_top_in_a_terminal_shows_the_workload_exactly(busy: DaemonProcess) -> None:
    with busy.client() as c:
        disk_used = render.human_bytes(c.stats().disk.used_bytes)
    child = _spawn(busy, "--interval", "0.3", "--iterations", "5")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    frame = _last_frame(child.before, "refresh 5/5")
    assert f"node {busy.node_id}" in _ANSI.sub("", child.before)
    assert re.search(r"ram\s+25\.0% \(3/12\)\s+-", frame)
    assert re.search(r"disk\s+8\.3% \(1/12\)\s+-", frame)
    assert re.search(r"all tiers\s+33\.3% \(4/12\)\s+-", frame)
    for name in ("committed", "read", "disk write", "disk read"):  # nothing moved while top watched
        assert re.search(rf"{name}\s+0 B/s", frame), name
    assert "100.0%" in _line(frame, r"^\s*ram\s+█") and "16.0 MiB of 16.0 MiB, 16 blocks" in frame
    assert f"{disk_used} of 64.0 MiB, 20 blocks" in _line(frame, r"^\s*disk\s+█")
    assert "leases 0   reservations 0   evictions 5 (0.0/s)   promotions 1 (0.0/s)" in frame
    assert "disk tier: healthy" in frame
    b, a = _line(frame, r"│ top/b "), _line(frame, r"│ top/a ")
    assert frame.index(b) < frame.index(a)  # same lookups this interval (0): more lookups in total first
    assert [cell.strip() for cell in b.split("│")[1:-1]] == ["top/b", "0", "-", "7", "0.0% (0/7)", "0", "0 B"]
    assert [cell.strip() for cell in a.split("│")[1:-1]] == ["top/a", "0", "-", "5", "80.0% (4/5)", "16", "16.0 MiB"]


def test_q_quits_at_once_and_restores_the_terminal(busy: DaemonProcess) -> None:
    child = _spawn(busy, "--interval", "0.2", shell_after="stty -a")
    child.expect("refresh 1")
    child.send("q")
    child.expect(pexpect.EOF, timeout=10)
    child.close()
    assert child.exitstatus == 0
    modes = child.before.split()
    assert "icanon" in modes and "echo" in modes  # not -icanon / -echo: cbreak mode was undone
    assert "Traceback" not in child.before


def test_ctrl_c_exits_0_without_a_traceback(busy: DaemonProcess) -> None:
    child = _spawn(busy, "--interval", "0.2")
    child.expect("refresh 2")
    child.sendintr()
    child.expect(pexpect.EOF, timeout=10)
    child.close()
    assert child.exitstatus == 0 and "Traceback" not in child.before


def test_top_json_reports_the_workload(busy: DaemonProcess, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["--address", busy.address, "--json", "top", "--interval", "0.05", "--iterations", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["total"] == {"lookups": 12, "ram": 3, "disk": 1, "peer": 0,
                            "hit_rate": {"ram": 0.25, "disk": 1 / 12, "peer": 0.0, "all": 4 / 12}}
    assert doc["recent"]["lookups"] == 0 and doc["recent"]["hit_rate"]["all"] is None
    assert [n["name"] for n in doc["namespaces"]] == ["top/b", "top/a"]
    assert (doc["blocks"], doc["disk_blocks"], doc["evictions"], doc["promotions"]) == (16, 20, 5, 1)
    assert doc["disk_state"] == "healthy" and doc["node_id"] == busy.node_id


def test_top_into_a_file_prints_only_the_last_frame(busy: DaemonProcess,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["--address", busy.address, "top", "--interval", "0.05", "--iterations", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("kvstore top") == 1 and "refresh 3/3" in out and "sampling" not in out


def test_interval_figures_are_exact_differences(make_daemon) -> None:
    d = make_daemon(arena_bytes="16MiB", max_block_bytes="1MiB")  # RAM only
    with d.client() as c:
        c.register_namespace("iv/x", tokens_per_block=16)
        c.register_namespace("iv/y")  # tokens unknown: left out of the token hit rate
        before = c.stats()
        # puts of 4 MiB; lookups: iv/x 3 (2 RAM hits), iv/y 4 (misses)
        assert c.put_many("iv/x", [b"k0", b"k1", b"k2", b"k3"], [b"\1" * MIB] * 4).stored == 4
        assert c.get_many("iv/x", [b"k0", b"k1", b"nope"])[2] is None
        assert c.get_many("iv/y", [b"a", b"b", b"c", b"d"]) == [None] * 4
        after = c.stats()
    v = build_view(before, after, elapsed_s=2.0)
    assert v.recent == Hits(lookups=7, ram=2, disk=0) and v.total == v.recent
    assert v.tokens_recent == Hits(lookups=48, ram=32, disk=0) and v.tokens_total == v.tokens_recent  # iv/x only
    assert v.committed_bytes_per_s == 2 * MIB  # 4 MiB in 2 s
    assert v.read_bytes_per_s == 1 * MIB  # 2 hits of 1 MiB in 2 s
    assert (v.disk_write_bytes_per_s, v.disk_read_bytes_per_s, v.evictions_per_s) == (0, 0, 0)
    assert [(n.name, n.lookups, n.hits) for n in v.namespaces] == [("iv/y", 4, 0), ("iv/x", 3, 2)]
    assert (v.disk_state, v.disk_used_bytes, v.blocks) == ("off", None, 4)
    text = _text(render_view(v, 1, None))
    assert re.search(r"ram\s+28\.6% \(2/7\)\s+28\.6% \(2/7\)", text)
    assert re.search(r"committed\s+2\.0 MiB/s", text) and re.search(r"disk\s+off", text)
    assert re.search(r"tokens\s+66\.7% \(32/48\)\s+66\.7% \(32/48\)", text)


def test_restart_top_ten_and_degraded_state(busy: DaemonProcess) -> None:
    with busy.client() as c:
        s = c.stats()
    many = [NamespaceInfo(f"ns{i:02d}", "", "", "", 1, 10, lookup_keys=i, hit_keys=0, puts=1) for i in range(12)]
    cur = dataclasses.replace(s, namespaces=many)
    v = build_view(dataclasses.replace(s, uptime_s=s.uptime_s + 1e6), cur, 1.0)  # uptime went back: restarted
    assert v.recent == v.total  # counted from zero, never negative
    assert [n.name for n in v.namespaces] == [f"ns{i:02d}" for i in range(11, 1, -1)]  # top 10 by lookups
    sick = dataclasses.replace(s, disk=dataclasses.replace(s.disk, degraded=True,
                                                           degraded_reason="no space left on device"))
    v = build_view(s, sick, 1.0)
    assert v.disk_state == "DEGRADED: no space left on device"
    assert "disk tier: DEGRADED: no space left on device" in _text(render_view(v, 1, 1))


def _text(renderable: object) -> str:
    console = Console(width=160, record=True, file=open(os.devnull, "w"))
    console.print(renderable)
    return console.export_text()


# -- inspect --------------------------------------------------------------------------------------------------
# Arena of 4 x 1 MiB blocks, disk admission seen:2 (a block gets a disk copy at its second use):
#   put a0..a3            -> all RAM only (first use)
#   get a0, get a1        -> both admitted, written to disk: ram+disk; LRU order now a2 a3 a0 a1
#   put b0, b1, b2        -> evict a2 (gone), a3 (gone), a0 (lives on disk); b* are RAM only
#   pin a1 twice; lease b0 once (a read: its second use, so b0 gets a disk copy too)
NS = "insp/ns"
SIZES = {b"a0": MIB, b"a1": MIB - 1, b"a2": MIB - 2, b"a3": MIB - 3, b"b0": MIB - 4, b"b1": MIB - 5, b"b2": MIB - 6}


def _place(tmp: Path) -> DaemonProcess:
    """A started daemon in the state drawn above (the caller closes it)."""
    d = _disk_daemon(tmp, arena_bytes="4MiB", disk_admission="seen:2").start()
    with d.client() as c:
        c.register_namespace(NS, tokens_per_block=16)
        first = [b"a0", b"a1", b"a2", b"a3"]
        assert c.put_many(NS, first, [b"a" * SIZES[k] for k in first]).stored == 4
        assert c.get(NS, b"a0") is not None and c.get(NS, b"a1") is not None
        _drain(c)
        for k in (b"b0", b"b1", b"b2"):
            assert c.put(NS, k, b"b" * SIZES[k])
        _drain(c)
        assert c.pin(NS, [b"a1"]) == 1 and c.pin(NS, [b"a1"]) == 1
        lease = c.lookup(NS, [b"b0"])  # held (not released) so inspect shows it
        assert lease.hits == 1
        _drain(c)
    return d


@pytest.fixture(scope="module")
def placed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """Shared by the tests that only read (Describe); the chain test places its own, as it ends with a Lookup."""
    d = _place(tmp_path_factory.mktemp("inspect"))
    try:
        yield d
    finally:
        d.close()


def _json(d: DaemonProcess, capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    capsys.readouterr()
    rc = main(["--address", d.address, "--json", "inspect", NS, *args])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def _rows(doc: dict) -> list[tuple]:
    return [(k["key_text"], k["tier"], k["size"], k["pins"], k["leases"], k["node"]) for k in doc["keys"]]


def test_inspect_keys_reports_each_tier_exactly(placed: DaemonProcess, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(placed, capsys, "a1", "hex:" + b"a0".hex(), "b0", "a2", "b2")
    n = placed.node_id
    assert doc["node"] == n and doc["namespace"] == NS and "chain" not in doc
    assert _rows(doc) == [("a1", "ram+disk", MIB - 1, 2, 0, n), ("a0", "disk", MIB, 0, 0, n),
                          ("b0", "ram+disk", MIB - 4, 0, 1, n), ("a2", "missing", None, None, None, None),
                          ("b2", "ram", MIB - 6, 0, 0, n)]
    ages = [k["age_s"] for k in doc["keys"]]
    assert ages[1] is None and ages[3] is None  # disk-only: unknown; missing: none
    assert all(0 <= ages[i] < 120 for i in (0, 2, 4))


def test_inspect_chain_prefix_and_counts_without_side_effects(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    chain = tmp_path / "chain.txt"
    chain.write_text("b2\na1\r\nhex:" + b"a0".hex() + "\nb0\n\na2\nb1\n")  # CRLF and a blank line are fine
    d = _place(tmp_path)
    try:
        with d.client() as c:
            before = c.stats().counters
            doc = _json(d, capsys, "--chain", str(chain))
            capsys.readouterr()
            assert main(["--address", d.address, "inspect", NS, "--chain", str(chain)]) == 0
            out = capsys.readouterr().out
            assert c.stats().counters == before  # no lookup counted, no promotion started
            assert c.describe(NS, [b"a0"])[0].tier == "disk"
            # the daemon's own prefix answer agrees (this Lookup does promote a0, so it comes last)
            assert c.lookup_prefix(NS, [b"b2", b"a1", b"a0", b"b0", b"a2", b"b1"]) == 4
    finally:
        d.close()
    assert doc["chain"] == {"length": 6, "prefix": 4, "prefix_bytes": 4 * MIB - 6 - 1 - 4, "prefix_tokens": 64,
                            "counts": {"ram": 2, "ram+disk": 2, "disk": 1, "peer": 0, "missing": 1},
                            "prefix_counts": {"ram": 1, "ram+disk": 2, "disk": 1, "peer": 0, "missing": 0}}
    assert [k["key_text"] for k in doc["keys"]] == ["b2", "a1", "a0", "b0", "a2", "b1"]
    flat = " ".join(out.split())  # the console wraps long lines at its width
    assert "present prefix: 4 of 6 keys (4.0 MiB, 64 tokens): ram 1, ram+disk 2, disk 1, peer 0, missing 0" in flat
    assert "whole chain: ram 2, ram+disk 2, disk 1, peer 0, missing 1" in out


def test_inspect_table_shows_tiers_and_dashes(placed: DaemonProcess, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["--address", placed.address, "inspect", NS, "a2", "b1"]) == 0
    out = capsys.readouterr().out
    assert f"{NS} on node {placed.node_id}: 2 key(s)" in out
    missing = [c.strip() for c in next(line for line in out.splitlines() if "│ a2" in line).split("│")[1:-1]]
    assert missing == ["0", "a2", "missing", "-", "-", "-", "-", "-"]
    ram = [c.strip() for c in next(line for line in out.splitlines() if "│ b1" in line).split("│")[1:-1]]
    assert ram[:6] == ["1", "b1", "ram", "1024.0 KiB", "0", "0"] and ram[7] == f"{placed.node_id} (ram)"


@pytest.mark.parametrize("args, message", [
    (["a1", "--chain", "x"], "not both"),
    ([], "at least one KEY"),
    (["--chain", "{missing}"], "cannot read"),
    (["--chain", "{bad}"], "bad.txt:2: 'hex:zz'"),
    (["--chain", "{empty}"], "holds no keys"),
])
def test_inspect_refuses_bad_requests(placed: DaemonProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      args: list[str], message: str) -> None:
    (tmp_path / "bad.txt").write_text("a1\nhex:zz\n")
    (tmp_path / "empty.txt").write_text("\n\n")
    files = {"missing": str(tmp_path / "nope.txt"), "bad": str(tmp_path / "bad.txt"),
             "empty": str(tmp_path / "empty.txt")}
    capsys.readouterr()
    rc = main(["--address", placed.address, "inspect", NS, *[a.format(**files) for a in args]])
    out, err = capsys.readouterr()
    assert (rc, out) == (2, "") and message in err


def test_inspect_unknown_namespace_exits_2(placed: DaemonProcess, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["--address", placed.address, "inspect", "never/registered", "k"]) == 2
    assert "unknown namespace 'never/registered'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["top", "inspect"])
def test_help_has_an_example(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    assert f"kvstore {command}" in capsys.readouterr().out.split("example:")[1]


@pytest.mark.parametrize("argv", [["top", "--interval", "0"], ["top", "--iterations", "0"],
                                  ["inspect", "ns", "hex:0"]])
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "usage: kvstore" in capsys.readouterr().err
