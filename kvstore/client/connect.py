"""What a client can use on connecting, decided from the daemon's Health: the arena mapping and the fast path.

Both need the daemon on this host (same hostname and boot id) and its same-node socket; each answers either
the thing or why not, and Client logs the why and falls back (stream data path, gRPC control path) unless the
caller insisted on the mode.
"""

from __future__ import annotations

import logging
import socket

from kvstore._proto import kvstore_pb2 as pb
from kvstore.arena.layout import ArenaLayout
from kvstore.client.arena_map import ArenaMap
from kvstore.client.control import FastControl, GrpcControl
from kvstore.client.fast_channel import FastChannel, request_arena
from kvstore.client.rpc import Rpc
from kvstore.errors import KVStoreError, StoreUnavailableError
from kvstore.fastpath import protocol as fp
from kvstore.hostinfo import boot_id

__all__ = ["map_arena", "open_fast"]

log = logging.getLogger(__name__)


def _elsewhere(h: pb.HealthResponse) -> str:
    """Why the daemon is not on this host, or '' when it is."""
    if h.hostname == socket.gethostname() and h.boot_id == boot_id():
        return ""
    return f"daemon runs on {h.hostname}, not on this host"


def map_arena(h: pb.HealthResponse, rpc: Rpc) -> tuple[ArenaMap | None, str]:
    """Ask the daemon for this tenant's arena file (after the token check) and map it; (None, why) if not."""
    a = h.arena
    why = _elsewhere(h)
    if why:
        return None, why
    if not a.socket:
        return None, "the daemon has no unix socket to hand out its arena (unix_socket is off)"
    try:
        layout = ArenaLayout(a.shm_name, a.n_slabs, a.slab_bytes, a.page_bytes)
    except KVStoreError as exc:
        return None, f"the daemon announced an arena this client cannot read ({exc})"
    if (layout.size_bytes, layout.data_offset) != (a.size_bytes, a.data_offset):
        return None, "the daemon's arena layout differs from this client's (mixed kvstore versions?)"
    try:
        fd, incarnation = request_arena(a.socket, rpc.token, rpc.timeout_s)
    except StoreUnavailableError as exc:
        return None, str(exc)
    try:
        return ArenaMap(fd, layout, incarnation, isolated=a.isolated), ""
    except OSError as exc:
        return None, f"cannot map the arena: {exc.strerror or exc}"


def open_fast(h: pb.HealthResponse, rpc: Rpc, grpc_control: GrpcControl, requested: str) -> FastControl | None:
    """The fast control path when `requested` is "fast" or "auto" and the daemon's socket is on this host;
    None for gRPC. requested="fast" raises StoreUnavailableError instead of falling back."""
    if requested == "grpc":
        return None
    why = _elsewhere(h)
    if not why and not h.arena.socket:
        why = "the daemon has no same-node socket (unix_socket is off)"
    elif not why:
        channel = FastChannel(h.arena.socket, rpc.token, rpc.timeout_s)
        try:
            channel.call(fp.ECHO, b"")  # dials and says HELLO: the token is checked now
            return FastControl(channel, grpc_control)
        except StoreUnavailableError as exc:
            channel.close()
            why = str(exc)
    if requested == "fast":
        raise StoreUnavailableError(f"control='fast' but {why}; use control='auto' or 'grpc'")
    log.info("kvstore client using gRPC for the control plane: %s", why)
    return None
