"""Shared pieces of the tenant tests: two tenants' tokens, their namespaces, and owner-only secret files."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvstore.client import Client
from kvstore.testing import DaemonProcess

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


def two_tenant_daemon(folder: Path) -> Iterator[tuple[DaemonProcess, str, str]]:
    """A daemon that knows alice's and bob's tokens, with each one's token file: the body of a module fixture
    (`yield from two_tenant_daemon(tmp_path_factory.mktemp("tokens"))`)."""
    tokens = secret(str(folder / "tokens"), f"alice {ALICE_TOKEN}\nbob {BOB_TOKEN}\n")
    alice = secret(str(folder / "alice.token"), ALICE_TOKEN + "\n")
    bob = secret(str(folder / "bob.token"), BOB_TOKEN + "\n")
    with DaemonProcess(tokens_file=tokens) as daemon:
        yield daemon, alice, bob


@contextlib.contextmanager
def tenant_clients(folder: Path, **kw: Any) -> Iterator[tuple[DaemonProcess, Client, Client]]:
    """A two-tenant daemon and alice's and bob's clients (`kw`: Client options), each tenant's namespace
    registered (A_NS, B_NS)."""
    gen = two_tenant_daemon(folder)
    d, alice_token, bob_token = next(gen)
    try:
        with Client(d.address, token_file=alice_token, **kw) as alice, \
                Client(d.address, token_file=bob_token, **kw) as bob:
            alice.register_namespace(A_NS)
            bob.register_namespace(B_NS)
            yield d, alice, bob
    finally:
        gen.close()
