"""What a client can use on connecting, decided from the daemon's Health: the arena mapping and the fast path.

Both need the daemon on this host (same hostname and boot id) and its same-node socket; each answers either
the thing or why not, and Client logs the why and falls back (stream data path, gRPC control path) unless the
caller insisted on the mode. map_arena also says whether the why can pass: a daemon on this host whose socket
did not answer (restarting, full, slow) is worth retrying, one on another host or without a socket is not.
"""

from __future__ import annotations

import logging
import socket
import time

from kvstore._proto import kvstore_pb2 as pb
from kvstore.arena.layout import ArenaLayout
from kvstore.client.arena_map import ArenaMap
from kvstore.client.control import FastControl, GrpcControl
from kvstore.client.fast_channel import FastChannel, request_arena, spin_us_from_env
from kvstore.client.rpc import Rpc
from kvstore.client.shared_index import SharedIndex, index_wanted
from kvstore.errors import KVStoreError, StoreUnavailableError
from kvstore.fastpath import protocol as fp
from kvstore.hostinfo import boot_id

__all__ = ["ARENA_PATIENCE_S", "ARENA_RETRY_S", "map_arena", "map_arena_patiently", "remap_arena", "open_fast", "streaming_because"]

ARENA_PATIENCE_S = 1.5  # how long a connect retries a handoff that failed for a reason that can pass
ARENA_RETRY_S = 5.0     # then, streaming in auto mode, how often the data path tries the handoff again

log = logging.getLogger(__name__)


def _elsewhere(h: pb.HealthResponse) -> str:
    """Why the daemon is not on this host, or '' when it is."""
    if h.hostname == socket.gethostname() and h.boot_id == boot_id():
        return ""
    return f"daemon runs on {h.hostname}, not on this host"


def map_arena(h: pb.HealthResponse, rpc: Rpc) -> tuple[ArenaMap | None, str, bool]:
    """Ask the daemon for this tenant's arena file (after the token check) and map it: (map, "", False), or
    (None, why, transient) where transient means the same request may succeed later (the socket did not answer:
    a daemon restarting, at its connection limit, or too slow), as opposed to a fact that will not change."""
    a = h.arena
    why = _elsewhere(h)
    if why:
        return None, why, False
    if not a.socket:
        return None, "the daemon has no unix socket to hand out its arena (unix_socket is off)", False
    try:
        layout = ArenaLayout(a.shm_name, a.n_slabs, a.slab_bytes, a.page_bytes)
    except KVStoreError as exc:
        return None, f"the daemon announced an arena this client cannot read ({exc})", False
    if (layout.size_bytes, layout.data_offset) != (a.size_bytes, a.data_offset):
        return None, "the daemon's arena layout differs from this client's (mixed kvstore versions?)", False
    try:
        fd, incarnation = request_arena(a.socket, rpc.token, rpc.timeout_s)
    except StoreUnavailableError as exc:
        return None, str(exc), True
    try:
        return ArenaMap(fd, layout, incarnation, isolated=a.isolated), "", False
    except OSError as exc:
        return None, f"cannot map the arena: {exc.strerror or exc}", False


def map_arena_patiently(h: pb.HealthResponse, rpc: Rpc, patience_s: float) -> tuple[ArenaMap | None, str, bool]:
    """map_arena, retried with backoff (50 ms, doubling) while the failure is transient, for up to patience_s:
    a client that connects while the daemon is still opening its socket (a restart) gets the arena, not a
    stream-mode fallback it would otherwise keep."""
    deadline = time.monotonic() + patience_s
    pause = 0.05
    while True:
        new, why, transient = map_arena(h, rpc)
        if new is not None or not transient or time.monotonic() + pause > deadline:
            return new, why, transient
        time.sleep(pause)
        pause *= 2


def streaming_because(why: str, transient: bool) -> float | None:
    """Say why an auto-mode client streams; when the reason can pass, the monotonic time to retry the arena."""
    if not transient:
        log.info("kvstore client using streaming gRPC: %s", why)
        return None
    log.warning("kvstore client streaming over gRPC for now (%s); retrying the arena every %.0f s", why, ARENA_RETRY_S)
    return time.monotonic() + ARENA_RETRY_S


def remap_arena(rpc: Rpc) -> tuple[pb.HealthResponse | None, ArenaMap | None, bool]:
    """One later try of the handoff for a client streaming after a transient failure: (Health, map or None,
    whether trying again later makes sense). An unreachable daemon is left to the next call's own error."""
    try:
        h = rpc.call("Health", pb.HealthRequest())
    except KVStoreError:
        return None, None, True
    new, why, transient = map_arena(h, rpc)
    if new is not None:
        log.warning("kvstore client: the daemon's arena is mapped again; bytes move through shared memory")
    elif not transient:
        log.info("kvstore client staying on streaming gRPC: %s", why)
    return h, new, new is None and transient


def open_fast(h: pb.HealthResponse, rpc: Rpc, grpc_control: GrpcControl, requested: str) -> FastControl | None:
    """The fast control path when `requested` is "fast" or "auto" and the daemon's socket is on this host;
    None for gRPC. requested="fast" raises StoreUnavailableError instead of falling back."""
    if requested == "grpc":
        return None
    why = _elsewhere(h)
    if not why and not h.arena.socket:
        why = "the daemon has no same-node socket (unix_socket is off)"
    elif not why:
        channel = FastChannel(h.arena.socket, rpc.token, rpc.timeout_s, spin_us_from_env())
        try:
            channel.call(fp.ECHO, b"")  # dials and says HELLO: the token is checked now
            index = SharedIndex(h.arena.socket, rpc.token, rpc.timeout_s) if index_wanted() else None
            return FastControl(channel, grpc_control, index)
        except StoreUnavailableError as exc:
            channel.close()
            why = str(exc)
    if requested == "fast":
        raise StoreUnavailableError(f"control='fast' but {why}; use control='auto' or 'grpc'")
    log.info("kvstore client using gRPC for the control plane: %s", why)
    return None
