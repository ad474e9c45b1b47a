"""Rotating and revoking tokens without a restart: the daemon re-reads tokens_file when it changes and on
SIGHUP (kvstore/server/token_reload.py), and keeps the previous tokens when the new file is invalid."""

from __future__ import annotations

import os
import signal

import grpc

from kvstore._proto import kvstore_pb2 as pb
from kvstore.testing import DaemonProcess, raw_stub, wait_until

ALICE = "alice-0123456789abcdef"
BOB = "bob-fedcba9876543210xx"
BOB2 = "bob-new-rotated-token1"   # same length as BOB: an in-place rewrite keeps the file's size


def _write(path: str, text: str, mode: int = 0o600) -> None:
    """Replace the file as an editor or a secret mount does: a new file renamed over the old one."""
    tmp = path + ".new"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _code(stub, token: str) -> grpc.StatusCode:
    try:
        stub.Health(pb.HealthRequest(), metadata=(("authorization", "Bearer " + token),), timeout=5)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def _log(d: DaemonProcess) -> str:
    with open(d.log_path, encoding="utf-8") as fh:
        return fh.read()


def test_tokens_file_changes_apply_without_a_restart(tmp_path) -> None:
    tokens = str(tmp_path / "tokens")
    _write(tokens, f"alice {ALICE}\n")
    ok, unauth = grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED
    with DaemonProcess(tokens_file=tokens) as d:
        ch, stub = raw_stub(d.address)
        with ch:
            assert (_code(stub, ALICE), _code(stub, BOB)) == (ok, unauth)
            _write(tokens, f"alice {ALICE}\nbob {BOB}\n")                      # add bob
            wait_until(lambda: _code(stub, BOB) == ok, timeout_s=10, what="bob's token accepted")
            assert _code(stub, ALICE) == ok
            _write(tokens, f"bob {BOB}\n")                                     # revoke alice
            wait_until(lambda: _code(stub, ALICE) == unauth, timeout_s=10, what="alice's token refused")
            assert _code(stub, BOB) == ok

            _write(tokens, f"bob {BOB}\n", mode=0o644)                         # readable by others: refused
            wait_until(lambda: "tokens_file not reloaded" in _log(d), timeout_s=10, what="the refusal logged")
            _write(tokens, "bob short\n")                                      # malformed: refused
            wait_until(lambda: _log(d).count("tokens_file not reloaded") == 2, timeout_s=10, what="second refusal")
            assert (_code(stub, BOB), _code(stub, ALICE)) == (ok, unauth)      # the previous table still serves
            assert "previous 1 tenant(s)" in _log(d)

            _write(tokens, f"bob {BOB}\n")
            wait_until(lambda: "tokens_file reloaded: 1 tenant(s)" in _log(d).rsplit("not reloaded", 1)[-1],
                       timeout_s=10, what="a valid file applied again")
            # SIGHUP reloads even when the file looks unchanged (same inode, size and mtime)
            before = os.stat(tokens)
            with open(tokens, "r+", encoding="utf-8") as fh:
                fh.write(f"bob {BOB2}\n")
            os.utime(tokens, ns=(before.st_atime_ns, before.st_mtime_ns))
            after = os.stat(tokens)
            assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size,
                                                                         before.st_mtime_ns)
            assert _code(stub, BOB) == ok   # not noticed without a signal
            assert d.proc is not None
            d.proc.send_signal(signal.SIGHUP)
            wait_until(lambda: _code(stub, BOB2) == ok, timeout_s=10, what="the rotated token after SIGHUP")
            assert _code(stub, BOB) == unauth
        assert d.proc.poll() is None   # SIGHUP does not stop the daemon
