"""Python client of kvstore-server: `Client` and its typed results (no protobuf leaks into user code).

    client.py        Client: the public API; connection, reconnects, the two-phase primitives, management calls
    data_calls.py    DataCalls (mixed into Client): put / get and their batched forms through the arena or streams
    spare_puts.py    puts into the connection's spare slots: a copy and one Store request
    slot_bank.py     SlotBank: spare slots taken and copied into on one thread, stored on another (connector saves)
    connect.py       on connecting: map the daemon's arena, open the same-node fast path (or say why not,
                     and whether the why can pass: then the handoff is retried)
    arena_slot.py    ArenaSlot: the current arena mapping, swapped on reconnect, and when to ask for it again
    control.py       the hot operations' two transports: GrpcControl and FastControl (same results)
    fast_channel.py  the same-node socket: framed calls, and the arena file handed over SCM_RIGHTS
    rpc.py           the gRPC seam: channel, TLS, token, and grpc errors -> kvstore errors
    arena_map.py     the mapped arena, reference-counted so a reconnect never unmaps under a copy
    arena_path.py    copies into and out of arena slots (gather / scatter, generation checks)
    stream_path.py   the Put / Get streams for clients that cannot map the arena
    releaser.py      lease releases off the caller's path (a background thread)
    probes.py        how much of a key chain every one of several namespaces holds (pipelined probes)
    shared_index.py  SharedIndex: the tenant's shared key index that probes read first, fetched again after a restart
    batches.py       split batches at max_batch_keys; spread per-hit results over the keys asked
    listing.py       Describe and Explain in batches, ListKeys page by page
    hinting.py       Hint in batches: an agent's hint on keys, one HintOutcome per key
    sessions.py      SessionCalls (mixed into Client): note a session's chain, explain it, list the session book
    routing.py       RoutingCalls (mixed into Client): annotate (vLLM identities for KV events), prefix_score
    events.py        EventStream: a Subscribe call as an iterator that any thread can close
    types.py         results of data operations: KeyInfo, KeyExplanation, PutResult, Reservation, Lease, KVEvent
    reports.py       Health, Stats and their parts, with the proto's names (mapped by kvstore.pbmap)
"""

from kvstore.client.client import Client, EventStream
from kvstore.client.types import (Health, KeyExplanation, KeyInfo, KVEvent, Lease, NamespaceInfo, NamespaceStats,
                                  PutResult, Reservation, SizeClassInfo, SizeClassStats, Stats)
from kvstore.client.routing import NodeScore
from kvstore.client.sessions import SessionExplanation, SessionInfo
from kvstore.origins import BlockOrigin  # Client.annotate's argument, re-exported
from kvstore.hint_vocab import HintAction, HintOutcome  # Client.hint's vocabulary, re-exported

__all__ = ["Client", "BlockOrigin", "EventStream", "KVEvent", "Health", "NodeScore", "HintAction", "HintOutcome", "KeyExplanation", "KeyInfo",
           "Lease", "NamespaceStats", "NamespaceInfo", "PutResult", "Reservation", "SessionExplanation", "SessionInfo",
           "SizeClassStats", "SizeClassInfo", "Stats"]
