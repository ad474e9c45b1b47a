"""The same-node control path's physical limit: a raw unix-socket request/response between two processes.

Why this is the limit the fast path is judged against: a fast-path call (kvstore/fastpath) is one request frame
and one reply frame over a unix socket between the client's process and the daemon's, each end in Python. Take
away everything the product does on top (decode, the engine, encode, metrics, token checks, socket timeouts,
threads competing for the GIL) and what is left is this: the same frame header, the same byte counts, the same
primitives (`sendall` of header + body, a `recv_into` loop until the frame is whole), a second process
that answers each request at once. Nothing in Python can do a round trip of those bytes much faster, so
`product / limit` says how much of the control path is the product's own work.

The peer runs in its own interpreter (`python -m bench.uds_limit --serve PATH`), not a fork of the benchmark:
forking a process that holds gRPC channels and threads is unsafe. Both sockets are blocking without timeouts
(a timeout makes CPython poll() before every recv: one more syscall, which is the product's choice, not the
limit's). Where the product polls before it sleeps (its client for DEFAULT_SPIN_US, the daemon for
DAEMON_SPIN_US while a client's calls come close together), so does the limit (`spin_us`, `peer_spin_us`): a
wake-up from sleep costs tens of microseconds on a VM, and the best the machine does is not to pay it. The
peer echoes a request's body back, except for ops given a fixed reply size (`--reply OP:BYTES`),
which it answers with that many bytes: a 280-key Lookup request gets a reply of a real 280-hit reply's size.
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from types import TracebackType

__all__ = ["UdsPeer", "HEADER"]

# the fast path's frame header (kvstore/fastpath/protocol.py HEADER): u32 length | u8 op | u8 flags | u16 status |
# u32 request id; repeated here so the peer process imports nothing but the standard library
HEADER = struct.Struct("<IBBHI")


def _recv_exact(sock: socket.socket, n: int, spin_s: float = 0.0) -> bytes:
    """The fast path's read: a bytearray filled by recv_into until whole (both ends do this); with `spin_s`, the
    first recv polls (MSG_DONTWAIT) for up to that long before it sleeps, as both ends of the product do."""
    buf = bytearray(n)
    view, pos = memoryview(buf), 0
    if spin_s:
        deadline = time.perf_counter() + spin_s
        while time.perf_counter() < deadline:
            try:
                got = sock.recv_into(view, n, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            if not got:
                raise ConnectionError("peer closed the connection")
            pos = got
            break
    while pos < n:
        got = sock.recv_into(view[pos:], n - pos)
        if not got:
            raise ConnectionError("peer closed the connection")
        pos += got
    return bytes(buf)


def serve(path: str, replies: dict[int, int], spin_us: int = 0) -> None:
    """Accept one connection on `path` and answer each frame until the client closes it; with `spin_us`, poll
    that long for the next request before sleeping (the daemon does so while a client's calls come close
    together, as they do in the benchmark)."""
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(path)
    lst.listen(1)
    conn, _ = lst.accept()
    lst.close()
    fixed = {op: bytes(n) for op, n in replies.items()}
    try:
        while True:
            length, op, _, _, rid = HEADER.unpack(_recv_exact(conn, HEADER.size, spin_us * 1e-6))
            body = _recv_exact(conn, length)
            reply = fixed.get(op, body)
            conn.sendall(HEADER.pack(len(reply), op, 0, 0, rid) + reply)
    except ConnectionError:
        pass
    finally:
        conn.close()


class UdsPeer:
    """The client end: `call(op, body)` sends one frame and returns the reply's body, as FastChannel.call does
    (header packed and concatenated with the body, one sendall, header then body read with recv_into)."""

    def __init__(self, replies: dict[int, int], timeout_s: float = 10.0, *, spin_us: int = 0,
                 peer_spin_us: int = 0) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="kvstore-uds-limit-")
        path = os.path.join(self._dir.name, "peer.sock")
        spec = [f"{op}:{n}" for op, n in replies.items()]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # `bench` importable from any cwd
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.uds_limit", "--serve", path,
                                      "--spin-us", str(peer_spin_us),
                                      *(a for s in spec for a in ("--reply", s))], env=env)
        self._spin_s = spin_us * 1e-6
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = time.monotonic() + timeout_s
        while True:  # the peer binds once its interpreter is up: poll with a deadline
            try:
                self.sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"the unix-socket peer did not listen on {path} within {timeout_s}s "
                                       f"(exit status {self.proc.returncode})") from None
                time.sleep(0.01)
        self._rid = 0

    def call(self, op: int, body: bytes) -> bytes:
        self._rid += 1
        self.sock.sendall(HEADER.pack(len(body), op, 0, 0, self._rid) + body)
        length, _, _, _, rid = HEADER.unpack(_recv_exact(self.sock, HEADER.size, self._spin_s))
        reply = _recv_exact(self.sock, length)
        if rid != self._rid:
            raise RuntimeError(f"reply {rid} to request {self._rid}")
        return reply

    def close(self) -> None:
        self.sock.close()  # the peer sees EOF and exits
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._dir.cleanup()

    def __enter__(self) -> UdsPeer:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def _reply_spec(text: str) -> tuple[int, int]:
    op, _, n = text.partition(":")
    return int(op), int(n)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m bench.uds_limit", description="the peer of bench.micro's "
                                 "unix-socket limit (started by UdsPeer; not meant to be run by hand)")
    ap.add_argument("--serve", required=True, metavar="PATH")
    ap.add_argument("--reply", action="append", default=[], type=_reply_spec, metavar="OP:BYTES")
    ap.add_argument("--spin-us", type=int, default=0, help="poll this long for each request before sleeping")
    args = ap.parse_args()
    serve(args.serve, dict(args.reply), args.spin_us)
