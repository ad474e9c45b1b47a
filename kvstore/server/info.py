"""Facts about this daemon that clients need: identity, host, arena layout (Health and Stats share them)."""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Callable

from kvstore._version import __version__
from kvstore._proto import kvstore_pb2 as pb
from kvstore.arena.backing import ArenaBacking
from kvstore.engine.results import EngineConfig
from kvstore.hostinfo import boot_id
from kvstore.pbmap import to_message
from kvstore.peer.cluster import PeerStatus
from kvstore.server.auth import current_tenant

__all__ = ["NodeInfo"]


class NodeInfo:
    def __init__(self, node_id: str, arena: ArenaBacking, engine_config: EngineConfig,
                 degraded: Callable[[], str] = lambda: "", incarnation: int = 0) -> None:
        """`incarnation`: a predecessor's, carried on by a hand-over that kept everything a client's offsets,
        leases and key index depend on (0: a new one)."""
        self.node_id = node_id
        self._arena = arena
        self._cfg = engine_config
        self._started = time.monotonic()
        self.status = "SERVING"
        self._degraded = degraded  # '' when every tier is healthy, else why not
        # Offsets handed out by this process are meaningless in another daemon's arena, even one with the
        # same shm name after a restart: clients compare this value before trusting an offset.
        self.incarnation = incarnation or (random.getrandbits(63) | 1)
        self.peer_status: Callable[[], PeerStatus] | None = None  # set by the daemon when the peer tier runs
        self.arena_socket = ""  # set by the daemon when it hands out arena files (server/fast_server.py)
        self.fast_status: Callable[[], dict[str, int]] | None = None  # the fast server's counters, when it runs
        self.kv_events = False  # set by the daemon when it publishes vLLM-format KV events

    def uptime_s(self) -> float:
        return time.monotonic() - self._started

    def arena_info(self) -> pb.ArenaInfo:
        lay = self._arena.layout
        return pb.ArenaInfo(shm_name=lay.name, size_bytes=lay.size_bytes, data_offset=lay.data_offset,
                            page_bytes=lay.page_bytes, gen_table_offset=lay.gen_table_offset,
                            locked=self._arena.locked, prefaulted=self._arena.prefaulted,
                            incarnation=self.incarnation, slab_bytes=lay.slab_bytes, n_slabs=lay.n_slabs,
                            socket=self.arena_socket, isolated=self._arena.isolated)

    def health(self) -> pb.HealthResponse:
        detail = self._degraded() if self.status == "SERVING" else ""
        return pb.HealthResponse(
            status="DEGRADED" if detail else self.status, detail=detail, node_id=self.node_id, version=__version__, hostname=socket.gethostname(),
            boot_id=boot_id(), pid=os.getpid(), arena=self.arena_info(),
            max_block_bytes=self._cfg.max_block_bytes, max_batch_keys=self._cfg.max_batch_keys,
            max_key_bytes=self._cfg.max_key_bytes, uptime_s=self.uptime_s(), peers=self.peer_stats(),
            tenant=current_tenant.get() or "",  # the caller's: its namespaces may carry it (kvstore_connector/namespace.py)
            kv_events=self.kv_events,
        )

    def control_stats(self) -> pb.ControlPlaneStats:
        c = self.fast_status() if self.fast_status is not None else {}
        return pb.ControlPlaneStats(socket=self.arena_socket, **c)

    def peer_stats(self) -> pb.PeerTierStats:
        """The peer tier for Health and Stats (enabled=false when this node runs alone)."""
        if self.peer_status is None:
            return pb.PeerTierStats(enabled=False, node_id=self.node_id)
        st = self.peer_status()
        # PeerStatus keeps the proto's names (by name, kvstore.pbmap); a Member's are its etcd record's JSON keys
        members = [pb.PeerMember(node_id=m.node_id, control_address=m.control, data_address=m.data,
                                 data_plane=m.plane, capacity_bytes=m.capacity_bytes, self=m.node_id == st.node_id)
                   for m in st.members]
        return to_message(st, pb.PeerTierStats, enabled=True, members=members)
