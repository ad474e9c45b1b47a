"""kvstore: a tiered KV-cache offload store for LLM serving.

    from kvstore import Client
    with Client() as c:                       # dials $KVSTORE_ADDRESS or the default unix socket
        c.register_namespace("llama@abc/default")
        c.put("llama@abc/default", b"key", b"bytes")
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
)

__all__ = [
    "__version__",
    "Client", "Health", "KeyInfo", "Lease", "NamespaceInfo", "PutResult", "Reservation", "Stats",
    "KVStoreError", "ConfigError", "StoreUnavailableError", "InvalidRequestError", "BatchTooLargeError",
    "UnknownNamespaceError", "UnknownReservationError", "ReservationClosedError", "ConflictError",
    "StoreFullError", "IntegrityError", "UnauthenticatedError", "PermissionDeniedError",
]
