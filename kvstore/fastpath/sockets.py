"""The two socket chores both ends of the same-node socket share (the protocol itself stays sans-IO)."""

from __future__ import annotations

import os
import socket
import time

from kvstore.errors import ConfigError

__all__ = ["recv_exact", "clear_stale_socket", "set_kernel_timeouts", "FrameReader", "DAEMON_SPIN_US", "MAX_SPIN_US"]

# The daemon's default for polling between a client's close frames (ServerConfig.fast_spin_us, FastServer)
DAEMON_SPIN_US = 200
# The most either end may be told to poll ($KVSTORE_SPIN_US on the client, fast_spin_us on the daemon)
MAX_SPIN_US = 10_000


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly n bytes, read with recv_into into one buffer; ConnectionError when the peer closes first."""
    buf = bytearray(n)
    view, pos = memoryview(buf), 0
    while pos < n:
        got = sock.recv_into(view[pos:], n - pos)
        if not got:
            raise ConnectionError("the other end closed the connection")
        pos += got
    return bytes(buf)


def clear_stale_socket(path: str, what: str) -> None:
    """Remove a socket file nobody listens on (left by a dead daemon); ConfigError when a process listens."""
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)
        return
    finally:
        probe.close()
    raise ConfigError(f"{what} {path} is in use by a running process: stop it or choose another unix_socket")


def set_kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Blocking socket with SO_RCVTIMEO / SO_SNDTIMEO: the kernel bounds each call, so no poll() precedes every
    recv and send as with Python's settimeout (one syscall per I/O instead of two). A call past the bound fails
    with EAGAIN (BlockingIOError)."""
    import struct

    sock.settimeout(None)
    sec = int(seconds)
    tv = struct.pack("ll", sec, int((seconds - sec) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


class FrameReader:
    """Whole frames off a stream socket with as few recv calls as the data allows: one `recv_into` usually
    brings a header and its body together (a Lookup's 4.5 KB request, its 9.5 KB reply). Bytes past the frame
    stay for the next one (pipelining). `header_size` and `body_length(header_bytes)` describe the format;
    `body_timeout` (seconds, None = none) bounds the wait for the rest of a frame once its header arrived."""

    def __init__(self, sock: socket.socket, header_size: int, body_length, body_timeout: float | None = None,
                 capacity: int = 1 << 16, spin_s: float = 0.0) -> None:
        self.sock = sock
        self._hsize = header_size
        self._body_length = body_length
        self._body_timeout = body_timeout
        self._buf = bytearray(capacity)
        self._start = self._end = 0
        self.spin_s = spin_s

    def _spin(self, view: memoryview) -> int:
        """Poll for data without sleeping for up to `spin_s`; the bytes read (0: none came, block instead).

        Why: a thread that sleeps in recv is woken by the kernel when the reply lands, and on a VM that wake-up
        (an idle vCPU halted, woken by an IPI through the hypervisor) costs 20-30 us, as much as the daemon's
        own work on a short request. A caller that expects its reply within microseconds keeps its CPU instead."""
        deadline = time.perf_counter() + self.spin_s
        recv, clock = self.sock.recv_into, time.perf_counter
        while True:
            try:
                got = recv(view, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if clock() >= deadline:
                    return 0
                continue
            if not got:
                raise ConnectionError("the other end closed the connection")
            return got

    def _fill(self, need: int, timeout: float | None) -> None:
        """Until `need` bytes are buffered from _start; compacts or grows the buffer as needed."""
        if self._start + need > len(self._buf):
            held = self._end - self._start
            if need > len(self._buf):
                new = bytearray(max(need, 2 * len(self._buf)))
                new[:held] = self._buf[self._start:self._end]
                self._buf = new
            else:
                self._buf[:held] = self._buf[self._start:self._end]
            self._start, self._end = 0, held
        view = memoryview(self._buf)
        timed = False
        try:
            while self._end - self._start < need:
                if timeout is not None and not timed:
                    self.sock.settimeout(timeout)
                    timed = True
                got = self._spin(view[self._end:]) if self.spin_s and not timed else 0
                if not got:
                    got = self.sock.recv_into(view[self._end:])
                if not got:
                    raise ConnectionError("the other end closed the connection")
                self._end += got
        finally:
            if timed:
                self.sock.settimeout(None)

    def frame_buffered(self) -> bool:
        """Whether the next frame is already whole in the buffer (a pipelined request: the daemon holds its
        reply to the one before and sends both in one write). False for a header `body_length` refuses."""
        held = self._end - self._start
        if held < self._hsize:
            return False
        try:
            n = self._body_length(bytes(self._buf[self._start:self._start + self._hsize]))
        except ValueError:
            return False
        return held >= self._hsize + n

    def frame(self) -> tuple[bytes, bytes]:
        """(header bytes, body bytes) of the next frame; `body_length` may raise to refuse a header."""
        self._fill(self._hsize, None)
        header = bytes(self._buf[self._start:self._start + self._hsize])
        n = self._body_length(header)
        self._fill(self._hsize + n, self._body_timeout)
        body = bytes(self._buf[self._start + self._hsize:self._start + self._hsize + n])
        self._start += self._hsize + n
        if self._start == self._end:
            self._start = self._end = 0
        return header, body
