"""kvstore: a tiered KV-cache offload store for LLM serving.

    from kvstore import Client
    with Client() as c:                       # dials $KVSTORE_ADDRESS or the default unix socket
        c.register_namespace("llama@abc/default")
        c.put("llama@abc/default", b"key", b"bytes")

This module re-exports the client, its result types and the exception tree. The map of the package (each
subpackage's __init__ has its own):

    vocab.py       the closed sets every layer shares (Tier, ReserveOutcome), equal to the proto's enums
    hint_vocab.py  the agent hints' vocabulary (HintAction, HintOutcome), the same on every way in
    errors.py      the one exception tree, shared by daemon and client, with its gRPC codes
    validation.py  input checks shared by the daemon (authoritative) and the client (early errors)
    origins.py     a block's vLLM identity (block hashes, parent, tokens) for the vLLM-format KV events
    pbmap.py       dataclass <-> protobuf message by field name (Stats on both sides of the wire)
    counters.py    CounterSet: the one implementation of named monotonic counters every layer shares
    transfers.py   data-plane bytes and latency / GB/s histograms, read at scrape time
    hostinfo.py    host facts shared by the daemon and its clients (boot id), byte views of buffers
    paths.py       default locations shared by the daemon and its clients (socket, address, disk dir)
    addresses.py   host:port values of the config, read once (no `$(HOST_IP)` left unexpanded, no wildcard to dial)
    _version.py    the package version
    _native/       the batched gather/scatter copy in C (GIL released)
    arena/         the shared-memory RAM tier: memfds, layout, slab allocator, libc wrappers
    policies/      eviction policies (LRU, S3-FIFO) and disk admission: decide only
    engine/        the catalog and the engine: leases, reservations, tiering, quotas, views
    tiers/         tiers below RAM: disk/ (O_DIRECT segment log + lmdb index)
    peer/          the peer tier: etcd membership, placement, data planes, pushes, prefetch
    security/      TLS material, tokens files, permission checks, etcd credentials
    fastpath/      the same-node control plane's binary frames (sans-IO)
    server/        the daemon: config, gRPC service, fast-path server, metrics, tenancy, main
    client/        the Client: arena and stream data paths, control channels, typed results
    cli/           the `kvstore` command
    testing/       test support: a real daemon, etcd, fuzzers, fault-injecting I/O
"""

from kvstore._version import __version__
from kvstore.client import Client, Health, KeyInfo, Lease, NamespaceInfo, PutResult, Reservation, Stats
from kvstore.errors import (
    BatchTooLargeError,
    ConfigError,
    ConflictError,
    IntegrityError,
    InvalidRequestError,
    KVStoreError,
    PermissionDeniedError,
    ReservationClosedError,
    StoreFullError,
    StoreUnavailableError,
    UnauthenticatedError,
    UnknownNamespaceError,
    UnknownReservationError,
    UnknownSessionError,
)

__all__ = [
    "__version__",
    "Client", "Health", "KeyInfo", "Lease", "NamespaceInfo", "PutResult", "Reservation", "Stats",
    "KVStoreError", "ConfigError", "StoreUnavailableError", "InvalidRequestError", "BatchTooLargeError",
    "UnknownNamespaceError", "UnknownReservationError", "ReservationClosedError", "ConflictError",
    "StoreFullError", "IntegrityError", "UnauthenticatedError", "PermissionDeniedError", "UnknownSessionError",
]
