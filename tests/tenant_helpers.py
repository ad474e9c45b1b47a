"""Shared pieces of the tenant tests: two tenants' tokens, their namespaces, and owner-only secret files."""

from __future__ import annotations

import os

ALICE_TOKEN = "alice-0123456789abcdef"
BOB_TOKEN = "bob-fedcba9876543210xx"
A_NS = "model@abc/alice"
B_NS = "model@abc/bob"


def secret(path: str, text: str) -> str:
    """Write `text` to an owner-only (0600) file, as the daemon and the client require for tokens."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return path
