"""The `kvstore` CLI against one real daemon: exact bytes, keys, counts and exit codes.

Most runs call `main([...])` in-process (fast, output via capsys); a few run `python -m kvstore.cli.main` as a
real subprocess, because binary stdout, stdin and the process exit code are only honest there. Each test uses
its own namespace, so the tests do not depend on their order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cli import commands
from kvstore.cli.main import main
from kvstore.testing import DaemonProcess

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess() as d:
        yield d


def _ns(tag: str) -> str:
    return f"cli-{tag}-{uuid.uuid4().hex[:8]}"


def _cli(daemon: DaemonProcess, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop anything printed before this run
    rc = main(["--address", daemon.address, *args])
    out, err = capsys.readouterr()
    return rc, out, err


def _json(daemon: DaemonProcess, capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    rc, out, err = _cli(daemon, capsys, "--json", *args)
    assert rc == 0, err
    return json.loads(out)  # exactly one document: json.loads rejects trailing text


def _subprocess(*args: str, stdin: bytes | None = None, address: str | None = None
                ) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "KVSTORE_ADDRESS": address} if address else None
    return subprocess.run([sys.executable, "-m", "kvstore.cli.main", *args], input=stdin, capture_output=True,
                          cwd=REPO, env=env, timeout=60)


def _put(daemon: DaemonProcess, capsys: pytest.CaptureFixture[str], tmp_path: Path, ns: str, key: str,
         data: bytes) -> None:
    f = tmp_path / f"block-{uuid.uuid4().hex}"
    f.write_bytes(data)
    rc, _, err = _cli(daemon, capsys, "put", ns, key, str(f))
    assert rc == 0, err


def test_put_then_get_is_byte_identical(daemon: DaemonProcess, capsys: pytest.CaptureFixture[str],
                                        tmp_path: Path) -> None:
    ns, data = _ns("roundtrip"), os.urandom(300 * 1024)
    src, dst = tmp_path / "in.bin", tmp_path / "out.bin"
    src.write_bytes(data)
    rc, out, _ = _cli(daemon, capsys, "put", ns, "blk", str(src))
    assert rc == 0 and f"registered namespace {ns}" in out and "307200 bytes" in out
    rc, out, _ = _cli(daemon, capsys, "get", ns, "blk", "-o", str(dst))
    assert rc == 0 and dst.read_bytes() == data
    # A real process: binary stdout must carry exactly the block, nothing more.
    proc = _subprocess("--address", daemon.address, "get", ns, "blk")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == data


def test_put_from_stdin_in_a_subprocess_addressed_by_env(daemon: DaemonProcess) -> None:
    ns, data = _ns("stdin"), os.urandom(5000)
    proc = _subprocess("put", ns, "hex:00ff", "-", "--json", stdin=data, address=daemon.address)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["stored"] is True and doc["registered_namespace"] is True and doc["key"] == "00ff"
    with daemon.client() as c:
        assert c.get(ns, b"\x00\xff") == data


def test_ls_json_lists_exact_keys_and_sizes(daemon: DaemonProcess, capsys: pytest.CaptureFixture[str],
                                            tmp_path: Path) -> None:
    ns = _ns("ls")
    blocks = {"alpha": 100, "beta": 4096, "hex:0001fe": 70000}
    for key, size in blocks.items():
        _put(daemon, capsys, tmp_path, ns, key, os.urandom(size))
    doc = _json(daemon, capsys, "ls", ns)
    got = {(k["key"], k["key_text"], k["size"]) for k in doc["keys"]}
    assert got == {(b"alpha".hex(), "alpha", 100), (b"beta".hex(), "beta", 4096), ("0001fe", None, 70000)}
    assert doc["count"] == 3 and doc["truncated"] is False
    assert [k["key"] for k in doc["keys"]] == sorted(k["key"] for k in doc["keys"])  # byte order
    limited = _json(daemon, capsys, "ls", ns, "--limit", "2")
    assert limited["count"] == 2 and limited["truncated"] is True


def test_stats_json_counts_blocks_and_bytes_exactly(daemon: DaemonProcess, capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path) -> None:
    ns, sizes = _ns("stats"), [1, 4095, 4096, 123457]
    before = _json(daemon, capsys, "stats")
    for i, size in enumerate(sizes):
        _put(daemon, capsys, tmp_path, ns, f"k{i}", os.urandom(size))
    after = _json(daemon, capsys, "stats")
    assert after["blocks"] - before["blocks"] == len(sizes)
    assert after["stored_bytes"] - before["stored_bytes"] == sum(sizes)
    row = next(n for n in after["namespaces"] if n["name"] == ns)
    assert (row["blocks"], row["bytes"], row["puts"]) == (len(sizes), sum(sizes), len(sizes))


def test_stats_human_output_names_namespace_and_block_count(daemon: DaemonProcess,
                                                            capsys: pytest.CaptureFixture[str],
                                                            tmp_path: Path) -> None:
    ns = _ns("human")
    for i in range(3):
        _put(daemon, capsys, tmp_path, ns, f"k{i}", os.urandom(1000))
    rc, out, _ = _cli(daemon, capsys, "stats")
    assert rc == 0
    row = next(line for line in out.splitlines() if ns in line)
    assert row.split("│")[3].strip() == "3"  # namespace | model | blocks | ...
    for heading in ("capacity", "allocated", "stored", "slot waste", "NOT locked", "size classes"):
        assert heading in out


def test_delete_reports_how_many_existed(daemon: DaemonProcess, capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:
    ns = _ns("delete")
    for key in ("a", "b", "c"):
        _put(daemon, capsys, tmp_path, ns, key, b"x" * 10)
    doc = _json(daemon, capsys, "delete", ns, "a", "b", "missing")
    assert doc == {"namespace": ns, "deleted": 2, "requested": 3}
    assert [k["key_text"] for k in _json(daemon, capsys, "ls", ns)["keys"]] == ["c"]
    rc, out, _ = _cli(daemon, capsys, "delete", ns, "c")
    assert rc == 0 and out.strip() == f"deleted 1 of 1 key(s) in {ns}"


def test_pin_then_show_counts_pins(daemon: DaemonProcess, capsys: pytest.CaptureFixture[str],
                                   tmp_path: Path) -> None:
    ns = _ns("pin")
    _put(daemon, capsys, tmp_path, ns, "hex:00", b"z" * 321)  # the smallest key: show starts at the beginning
    _put(daemon, capsys, tmp_path, ns, "p", b"z" * 123)
    assert _json(daemon, capsys, "pin", ns, "p", "nope")["pinned"] == 1
    shown = _json(daemon, capsys, "show", ns, "p")
    assert (shown["found"], shown["key_text"], shown["size"], shown["pins"]) == (True, "p", 123, 1)
    assert _json(daemon, capsys, "show", ns, "hex:00")["size"] == 321
    assert _json(daemon, capsys, "unpin", ns, "p")["unpinned"] == 1
    assert _json(daemon, capsys, "show", ns, "p")["pins"] == 0
    rc, out, _ = _cli(daemon, capsys, "show", ns, "p")
    assert rc == 0 and "123 bytes" in out


def test_get_and_show_of_a_missing_key_exit_1(daemon: DaemonProcess, capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    ns = _ns("miss")
    _put(daemon, capsys, tmp_path, ns, "there", b"1")
    rc, out, err = _cli(daemon, capsys, "get", ns, "absent")
    assert (rc, out) == (1, "") and f"key 'absent' not found in namespace '{ns}'" in err
    rc, out, err = _cli(daemon, capsys, "--json", "show", ns, "absent")
    assert rc == 1 and json.loads(out)["found"] is False and "not found" in err


def test_unknown_namespace_exits_2_with_the_message(daemon: DaemonProcess, capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path) -> None:
    ns = _ns("never")
    rc, out, err = _cli(daemon, capsys, "ls", ns)
    assert (rc, out) == (2, "")
    assert err.startswith("kvstore: error: ") and f"unknown namespace '{ns}'" in err
    f = tmp_path / "b.bin"
    f.write_bytes(b"data")
    rc, _, err = _cli(daemon, capsys, "put", ns, "k", str(f), "--no-register")
    assert rc == 2 and f"unknown namespace '{ns}'" in err


def test_unreachable_daemon_exits_2_and_says_how_to_start_it(tmp_path: Path) -> None:
    proc = _subprocess("--address", f"unix:{tmp_path}/no-such.sock", "--timeout", "2", "stats")
    assert proc.returncode == 2
    assert proc.stdout == b""
    err = proc.stderr.decode()
    assert err.startswith("kvstore: error: ") and "kvstore-server" in err and "Traceback" not in err


def test_clear_requires_yes(daemon: DaemonProcess, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ns = _ns("clear")
    for key in ("a", "b"):
        _put(daemon, capsys, tmp_path, ns, key, b"q" * 50)
    rc, _, err = _cli(daemon, capsys, "clear", ns)
    assert rc == 2 and "--yes" in err
    assert _json(daemon, capsys, "ls", ns)["count"] == 2  # nothing deleted
    assert _json(daemon, capsys, "clear", ns, "--yes") == {"namespace": ns, "deleted": 2}
    assert _json(daemon, capsys, "ls", ns)["count"] == 0


def test_put_refuses_unreadable_empty_and_oversized_files(daemon: DaemonProcess,
                                                          capsys: pytest.CaptureFixture[str],
                                                          tmp_path: Path) -> None:
    ns = _ns("refuse")
    rc, _, err = _cli(daemon, capsys, "put", ns, "k", str(tmp_path / "nope.bin"))
    assert rc == 2 and "cannot read" in err
    (tmp_path / "empty").write_bytes(b"")
    rc, _, err = _cli(daemon, capsys, "put", ns, "k", str(tmp_path / "empty"))
    assert rc == 2 and "empty" in err
    (tmp_path / "big").write_bytes(b"\0" * (4 * 1024 * 1024 + 1))  # DaemonProcess sets max_block_bytes=4MiB
    rc, _, err = _cli(daemon, capsys, "put", ns, "k", str(tmp_path / "big"))
    assert rc == 2 and "max_block_bytes" in err


def test_health(daemon: DaemonProcess, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(daemon, capsys, "health")
    assert doc["status"] == "SERVING" and doc["node_id"] == daemon.node_id
    assert (doc["client_control"], doc["client_data"], doc["client_probe"]) == ("fast", "arena", "index")
    rc, out, _ = _cli(daemon, capsys, "health")
    assert rc == 0 and "SERVING" in out


def test_closed_stdout_pipe_exits_1_quietly(daemon: DaemonProcess, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def reader_left(*_: object) -> int:
        raise BrokenPipeError

    monkeypatch.setitem(commands.COMMANDS, "stats", reader_left)
    rc, _, err = _cli(daemon, capsys, "stats")
    assert (rc, err) == (1, "")


@pytest.mark.parametrize("command", ["stats", "health", "ls", "show", "put", "get", "delete", "pin", "unpin",
                                     "clear"])
def test_each_command_has_help_with_an_example(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    assert f"kvstore {command}" in capsys.readouterr().out.split("example:")[1]


@pytest.mark.parametrize("argv", [["get", "ns", "hex:zz"], ["get", "ns", ""], ["ls", "ns", "--limit", "-1"],
                                  ["--timeout", "0", "stats"], ["frobnicate"], []])
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "usage: kvstore" in capsys.readouterr().err
