"""The peer tier's counters: a kvstore.counters.CounterSet with its own lock, read at scrape time and by Stats.

Its own lock (LOCKED) because they are fed from the peer threads (data-plane servers, fetchers, pushers,
membership), never under the engine lock: bump them with add(name, n), which takes it.
"""

from __future__ import annotations

from kvstore.counters import CounterSet

__all__ = ["PeerCounters", "COUNTER_HELP"]

# name -> help; every name is a Prometheus counter kvstore_peer_<name>_total and a key of Stats.peers.counters
COUNTER_HELP: dict[str, str] = {
    "fetch_calls": "Batched fetch calls made to peers (one per peer per local miss batch)",
    "fetch_keys": "Keys asked of peers",
    "fetched_blocks": "Blocks fetched from peers into the local arena",
    "fetch_misses": "Keys a peer did not have, or that a failed call turned into misses",
    "probe_calls": "Metadata-only calls asking peers which keys they hold (a Lookup without lease)",
    "prefetch_keys": "Keys a probe found on peers and fetched in the background (prefetch)",
    "prefetch_skipped": "Keys not probed because too many prefetches were in flight (counted as misses)",
    "served_blocks": "Blocks this node sent to peers that asked for them",
    "pushed_blocks": "Blocks pushed to their owner after a local put",
    "pushes_dropped": "Pushes dropped: queue full, peer down, timeout or error (never blocks a put)",
    "received_pushes": "Blocks other nodes pushed here and this node stored",
    "errors": "Peer calls that failed (refused, reset, protocol error)",
    "timeouts": "Peer calls that ran past peer_timeout_s (their keys are misses)",
    "frame_errors": "Malformed, oversized or truncated frames received; the connection was closed",
    "frame_deadline_exceeded": "Frames (requests served, replies read) or calls not complete by their deadline "
                               "(peer_timeout_s from their first byte): connection closed, reservation aborted",
    "slot_deadline_exceeded": "Received frames whose bytes would have landed after their reservation's safe end "
                              "(reservation_ttl_s less a margin): reservation aborted, the rest drained to scratch",
    "idle_closed": "Data-plane connections closed after peer_idle_timeout_s without a frame",
    "idle_evicted": "Idle data-plane connections closed to admit a new one when the listener was full",
    "conn_refused": "Data-plane connections refused: the listener was full of connections mid-frame",
    "tls_handshake_failures": "Data-plane connections refused at the TLS handshake (no or untrusted certificate)",
    "checksum_failures": "Blocks from a peer whose xxh3 did not match (misses, not stored)",
    "etcd_errors": "Failed calls to etcd (the node keeps serving its own tiers)",
    "rejoins": "Times this node registered itself in etcd (first join included)",
    "member_changes": "Changes of the member set this node saw (a join, a leave, a death; its own join)",
    "watch_restarts": "Member watches opened again after etcd ended one (restart, compaction, lost stream)",
    "fallback_keys": "Keys asked of a previous owner because their current owner did not hold them "
                     "(a hand-off still under way)",
    "fallback_hits": "Keys a previous owner held and this node fetched (or found) through it",
    "handoff_scans": "Hand-off passes over this node's blocks after membership changes (or a leave)",
    "handoff_catch_ups": "Second passes over the keys that arrived during a hand-off and its grace (settling)",
    "handoff_settles": "Times this node had handed off everything for the current member set and said so in etcd "
                       "(once every member has, reads stop asking previous owners)",
    "handoff_keys_scanned": "Keys a hand-off pass looked at",
    "handoff_blocks": "Blocks handed to a new owner after a membership change (stored there)",
    "handoff_bytes": "Bytes of the blocks handed to new owners",
    "handoff_present": "Blocks a hand-off found at their new owner already (not sent again)",
    "handoff_dropped": "Blocks a hand-off could not deliver: owner down, call failed, refused, or the leave's "
                       "deadline passed",
    "handoff_received": "Blocks other nodes handed to this node that it stored",
    "handoff_refused": "Handed-off blocks refused because this node does not own them (dropped, counted)",
    "handoff_flood_refused": "Hand-off frames refused whole because hand-offs arrived faster than "
                             "peer_handoff_intake_bytes_per_s",
    "guest_copies": "RAM copies of blocks this node does not own, dropped or marked first to go once their "
                    "owner had them (pushed, fetched and read, or handed over; peer_local_copies)",
    "exists_remote_calls": "Metadata-only calls asking owners about keys a cluster-wide Exists missed here",
    "exists_remote_hits": "Keys a cluster-wide Exists found at a peer",
    "claim_calls": "Claiming probes sent to owners (a scheduler's Claim of keys it is about to compute)",
    "claim_pending_keys": "Keys an owner answered pending: another scheduler is computing them (the caller waits "
                          "for that save instead of computing them too)",
    "score_calls": "Prefix scores computed here (PrefixScore: one tiers probe per peer each)",
}


class PeerCounters(CounterSet):
    """The peer tier's counters: add(name, n) from any thread (a name outside COUNTER_HELP: AttributeError)."""

    __slots__ = tuple(COUNTER_HELP)
    LOCKED = True
