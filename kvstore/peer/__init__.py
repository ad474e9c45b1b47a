"""The remote peer tier: kvstore-servers that share blocks over etcd membership and a TCP / UCX data plane.

    cluster.py       PeerCluster, the facade the daemon builds (PeerConfig in, engine hooks out)
    membership.py    this node's lease and record in etcd; the live member set, by watch
    etcd.py          a minimal etcd v3 JSON-gateway client (standard library only)
    etcd_watch.py    one watch stream on a key prefix over that gateway
    change.py        a membership change as a value; the member view with its hand-off window
    placement.py     rendezvous hashing: the owner (and replica) of a block, hand-off targets, read order
    handoff.py       after a change: hand the blocks this node holds to their new owners (and on leave)
    intake.py        what a node takes when handed blocks: ownership and a byte budget
    guests.py        copies of blocks this node does not own: dropped once their owner has them
    remote_tier.py   reads: a local miss asks the owner, one batched call per peer
    replicator.py    writes: after a put, push to the owner in the background (bounded, never blocks)
    scores.py        a prefix score per member: the leading blocks each would serve from RAM, disk and peers
    local.py         the local arena for the peer tier: open leased blocks to send, reserve slots to receive
    plane.py         the DataPlane interface and its errors
    frames.py        the framed wire format (header, metadata, their encoders and decoders)
    protocol.py      the protocol without I/O, shared by both planes: requests, reply checks, serve(), receive plans
    tcp_plane.py     the default data plane, client side (one deadline per call; a pool of connections)
    tcp_server.py    its listener: one deadline per request frame, idle timeout, longest-idle eviction
    tcp_blocks.py    receiving blocks into reserved slots (bounded by the reservation) and sending from leases
    conn_table.py    the listener's connections, idle or busy
    sockio.py        deadline-bounded recv / drain / send helpers
    deadline.py      one fixed point in time per frame or call (socket timeouts recomputed before each I/O)
    ucx_plane.py     UCX through ucxx
    ucx_runtime.py   the process's one UCX event loop, ucxx initialised on it with Python futures
    grpc_plane.py    the daemon's own Get/Put streams, the last fallback
    counters.py      the tier's counters
"""

from kvstore.peer.cluster import COPIES, PeerCluster, PeerConfig, PeerStatus
from kvstore.peer.membership import Member

__all__ = ["PeerCluster", "PeerConfig", "PeerStatus", "Member", "COPIES"]
