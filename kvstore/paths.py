"""Default locations shared by the daemon and its clients."""

from __future__ import annotations

import os

__all__ = ["default_socket_path", "default_address", "default_disk_dir"]


def default_socket_path() -> str:
    """Per-user runtime directory, so two users' daemons never collide and the socket stays private."""
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvstore-{os.getuid()}"
    return os.path.join(base, "kvstore.sock")


def default_address() -> str:
    """What a client dials when told nothing: $KVSTORE_ADDRESS, else the default unix socket."""
    return os.environ.get("KVSTORE_ADDRESS") or "unix:" + default_socket_path()


def default_disk_dir() -> str:
    """The disk tier lives in the user's cache directory unless configured: it is a cache, not data."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvstore", "disk")
