"""The one exception tree of kvstore, shared by the daemon and the client.

Expected outcomes (a miss, a key already present) are return values, never exceptions. Exceptions are for
requests that cannot be served as asked and for misconfiguration. The daemon raises these classes inside the
engine; the gRPC service turns each into its status code plus a trailing-metadata reason, and the client turns
the reason back into the same class, so a caller catches the same type whether the check ran locally or in
the daemon::

    KVStoreError
     ├── ConfigError                 bad configuration (startup; fails loudly)
     ├── StoreUnavailableError       daemon unreachable, deadline exceeded, shutting down   UNAVAILABLE
     ├── InvalidRequestError         malformed key / size / batch / argument                  INVALID_ARGUMENT
     │    └── BatchTooLargeError     more keys than max_batch_keys                            INVALID_ARGUMENT
     ├── UnknownNamespaceError       namespace never registered                               NOT_FOUND
     ├── UnknownReservationError     reservation id never issued by this daemon               NOT_FOUND
     ├── ReservationClosedError      reservation already committed, aborted or expired        FAILED_PRECONDITION
     ├── ConflictError               namespace re-registered with another spec                ALREADY_EXISTS
     ├── StoreFullError              nothing evictable can make room (or tenant quota)        RESOURCE_EXHAUSTED
     ├── UnauthenticatedError        tokens are configured and the call has no valid one      UNAUTHENTICATED
     ├── PermissionDeniedError       the caller's tenant may not do this                      PERMISSION_DENIED
     └── IntegrityError              bytes failed their checksum                              DATA_LOSS
"""

from __future__ import annotations

__all__ = [
    "KVStoreError",
    "ConfigError",
    "StoreUnavailableError",
    "InvalidRequestError",
    "BatchTooLargeError",
    "UnknownNamespaceError",
    "UnknownReservationError",
    "ReservationClosedError",
    "ConflictError",
    "StoreFullError",
    "IntegrityError",
    "UnauthenticatedError",
    "PermissionDeniedError",
    "UnknownSessionError",
    "error_for_reason",
]


class KVStoreError(Exception):
    """Base of every kvstore error. `reason` is stable and machine-readable; `grpc_code` names the status."""

    reason = "internal"
    grpc_code = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigError(KVStoreError):
    reason = "config"
    grpc_code = "INVALID_ARGUMENT"


class StoreUnavailableError(KVStoreError):
    reason = "unavailable"
    grpc_code = "UNAVAILABLE"


class InvalidRequestError(KVStoreError):
    reason = "invalid_request"
    grpc_code = "INVALID_ARGUMENT"


class BatchTooLargeError(InvalidRequestError):
    reason = "batch_too_large"


class UnknownNamespaceError(KVStoreError):
    reason = "unknown_namespace"
    grpc_code = "NOT_FOUND"


class UnknownReservationError(KVStoreError):
    reason = "unknown_reservation"
    grpc_code = "NOT_FOUND"


class ReservationClosedError(KVStoreError):
    reason = "reservation_closed"
    grpc_code = "FAILED_PRECONDITION"


class ConflictError(KVStoreError):
    reason = "conflict"
    grpc_code = "ALREADY_EXISTS"


class StoreFullError(KVStoreError):
    reason = "store_full"
    grpc_code = "RESOURCE_EXHAUSTED"


class IntegrityError(KVStoreError):
    reason = "integrity"
    grpc_code = "DATA_LOSS"


class UnauthenticatedError(KVStoreError):
    reason = "unauthenticated"
    grpc_code = "UNAUTHENTICATED"


class PermissionDeniedError(KVStoreError):
    reason = "permission_denied"
    grpc_code = "PERMISSION_DENIED"


class UnknownSessionError(KVStoreError):
    """A session the daemon's session book does not hold (never noted, or forgotten): NOT_FOUND."""

    reason = "unknown_session"
    grpc_code = "NOT_FOUND"


_BY_REASON: dict[str, type[KVStoreError]] = {
    cls.reason: cls
    for cls in (
        KVStoreError,
        ConfigError,
        StoreUnavailableError,
        InvalidRequestError,
        BatchTooLargeError,
        UnknownNamespaceError,
        UnknownReservationError,
        ReservationClosedError,
        ConflictError,
        StoreFullError,
        IntegrityError,
        UnauthenticatedError,
        PermissionDeniedError,
        UnknownSessionError,
    )
}


def error_for_reason(reason: str) -> type[KVStoreError]:
    """The exception class for a reason sent by the daemon (the base class for reasons we do not know)."""
    return _BY_REASON.get(reason, KVStoreError)
