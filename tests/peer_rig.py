"""One peer node in this process: a real engine over an arena-shaped buffer, its LocalStore and a real data plane
listening on loopback. The arena is a numpy buffer (the daemon's stitched view has the same layout) that a test
can scan byte by byte, and nothing else writes into it: every byte found there came through the plane under
test or the test's own `put`.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import numpy as np

from kvstore.arena.allocator import SlabAllocator
from kvstore.arena.layout import ArenaLayout
from kvstore.engine.engine import Engine
from kvstore.engine.results import RESERVED, EngineConfig
from kvstore.peer.counters import PeerCounters
from kvstore.peer.frames import NamespaceDesc
from kvstore.peer.local import LocalStore
from kvstore.peer.membership import Member
from kvstore.peer.plane import DataPlane
from kvstore.policies import make_policy
from kvstore.transfers import TransferMeter

__all__ = ["Node", "make_node", "NS", "DESC", "BLOCK", "addr", "closed_by_peer", "still_open"]

NS = "m@d/t"
DESC = NamespaceDesc(NS, "m", "d", "t", 0)
BLOCK = 64 << 10
MiB = 1 << 20


@dataclass
class Node:
    engine: Engine
    view: np.ndarray          # the whole arena mapping: offsets from the engine index it directly
    counters: PeerCounters
    local: LocalStore
    plane: DataPlane
    member: Member

    def put(self, key: bytes, value: bytes) -> int:
        """Reserve, copy, commit one block (as a local client would); its slot offset."""
        r = self.engine.reserve(NS, [key], [len(value)])
        assert r.outcomes == [RESERVED]
        off = r.offsets[0]
        self.view[off: off + len(value)] = np.frombuffer(value, dtype=np.uint8)
        assert self.engine.commit(r.reservation_id) == 1
        return off

    def read(self, key: bytes) -> bytes | None:
        """The block's bytes as a leased local read sees them, or None when it is not here."""
        out = self.local.open_for_send(NS, [key])
        try:
            return bytes(out.views[0]) if out.views else None
        finally:
            out.close()

    def stats(self) -> tuple[int, int, dict[str, int]]:
        """(active reservations, reserved bytes, engine counters)."""
        s = self.engine.stats()
        return s.reservations_active, s.reserved_bytes, s.counters

    def close(self) -> None:
        self.plane.stop()


def make_node(name: str, *, plane: str = "tcp", timeout_s: float = 1.0, reservation_ttl_s: float = 30.0,
              data_bytes: int = 8 * MiB, **plane_opts: object) -> Node:
    layout = ArenaLayout.for_capacity(f"rig-{name}", data_bytes, MiB)
    view = np.zeros(layout.size_bytes, dtype=np.uint8)
    gens = np.zeros(layout.gen_table_bytes // 8, dtype=np.uint64)
    alloc = SlabAllocator(layout.data_offset, layout.data_bytes, MiB)
    engine = Engine(EngineConfig(max_block_bytes=MiB, reservation_ttl_s=reservation_ttl_s,
                                 quarantine_s=reservation_ttl_s, high_watermark=1.0, low_watermark=1.0),
                    layout, gens, alloc, make_policy("lru"))
    engine.register_namespace(NS, DESC.model, DESC.layout_digest, DESC.tenant)
    counters = PeerCounters()
    local = LocalStore(engine, view, counters)
    common = dict(listen="127.0.0.1:0", advertise="", timeout_s=timeout_s, max_keys=64, max_block_bytes=MiB)
    if plane == "tcp":
        from kvstore.peer.tcp_plane import TcpPlane
        dp: DataPlane = TcpPlane(local, counters, TransferMeter(), **common, **plane_opts)  # type: ignore[arg-type]  # common mixes str, int and float options
    else:
        from kvstore.peer.ucx_plane import UcxPlane
        dp = UcxPlane(local, counters, TransferMeter(), **common, **plane_opts)  # type: ignore[arg-type]  # common mixes str, int and float options
    dp.start()
    return Node(engine, view, counters, local, dp, Member(name, "", dp.address, plane, data_bytes))


def addr(node: Node) -> tuple[str, int]:
    host, _, port = node.plane.address.rpartition(":")
    return host, int(port)


def closed_by_peer(sock: socket.socket, timeout_s: float) -> float | None:
    """Block until the other side closes `sock` (EOF or reset); the monotonic time it did, None if it did not."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return None
    return time.monotonic()


def still_open(sock: socket.socket) -> bool:
    """True while the other side has neither closed `sock` nor sent anything on it (nothing to read)."""
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)
        return False  # EOF, or bytes nobody asked for
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(True)
