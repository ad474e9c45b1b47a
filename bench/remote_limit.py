"""bench.remote's limit: BATCH blocks of BLOCK bytes over one loopback TCP connection between two processes.

The same resources as kvstore's remote get: one connection, one sending thread in another process, one
receiving thread, and buffers of the arena's kind (memfd mappings, pre-faulted) at both ends. Two ways to
drive the socket, both measured in the same run; the faster median is the limit (bench.remote says which):

    plain   the kernel's defaults (autotuned socket buffers); sendall each block, recv_into until it is full
    tuned   the socket as the TCP plane sets it up (kvstore.peer.sockio.tune: no Nagle, 4 MiB buffers)

Why both: the product's socket settings must not be allowed to make the limit weaker (if the plane's buffers
were the slower choice, the plain socket would show it), nor the product beat the limit with a trick the raw
socket did not get.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import socket

import numpy as np

from kvstore.peer.sockio import tune

__all__ = ["RawSocket", "shared_buffer", "VARIANTS"]

VARIANTS = ("plain", "tuned")


def shared_buffer(total: int) -> np.ndarray:
    """`total` bytes of the memory the arena is made of (a memfd mapped shared), pre-faulted. (Measured here:
    a receive into such a mapping costs no more CPU than into private anonymous memory, often less.)"""
    fd = os.memfd_create("bench-remote", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, total)
        buf = np.frombuffer(mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), dtype=np.uint8)
    finally:
        os.close(fd)
    buf[:] = 1
    return buf


def _sender(port: int, total: int, block: int, variant: str) -> None:
    """Child process: for each 8-byte request, send `total` bytes in `block` pieces from one buffer."""
    buf = shared_buffer(total)
    with socket.create_connection(("127.0.0.1", port)) as s:
        if variant == "tuned":
            tune(s)
        else:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        view = memoryview(buf)  # type: ignore[arg-type]  # numpy's stubs do not declare ndarray a Buffer
        while True:
            req = s.recv(8)
            if len(req) < 8:
                return
            for pos in range(0, total, block):
                s.sendall(view[pos: pos + block])


class RawSocket:
    """One connection to a sender process; `get()` asks for `total` bytes and receives them into one buffer."""

    def __init__(self, total: int, block: int, variant: str = "plain") -> None:
        if variant not in VARIANTS:
            raise ValueError(f"raw socket variant {variant!r}: use one of {VARIANTS}")
        self.total, self.block, self.variant = total, block, variant
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        self.proc = mp.get_context("spawn").Process(target=_sender, args=(srv.getsockname()[1], total, block, variant),
                                                    daemon=True)
        self.proc.start()
        self.sock, _ = srv.accept()
        srv.close()
        if variant == "tuned":
            tune(self.sock)
        self.dst = shared_buffer(total)
        self.view = memoryview(self.dst)  # type: ignore[arg-type]  # numpy's stubs do not declare ndarray a Buffer

    def get(self, _: object = None) -> None:
        self.sock.sendall(b"\x00" * 8)
        block = self.block
        for pos in range(0, self.total, block):
            v = self.view[pos: pos + block]
            got = 0
            while got < block:
                got += self.sock.recv_into(v[got:], block - got)

    def close(self) -> None:
        self.sock.close()
        self.proc.join(5)
