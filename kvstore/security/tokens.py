"""Bearer tokens: the daemon's tokens file maps each token to a tenant; a client reads its one token from a file.

Daemon file (`tokens_file`), one `tenant token` pair a line, `#` comments and blank lines ignored::

    # tenant   token (>= 16 characters, e.g. `python -c "import secrets; print(secrets.token_urlsafe(32))"`)
    alice      2b7d1f...
    bob        9c04aa...

A tenant may have several tokens (rotation: add the new one, move clients, remove the old one; the daemon
re-reads the file when it changes and on SIGHUP, see kvstore/server/token_reload.py).
The file must be owner-only (mode 0600 or stricter): it is refused otherwise, like ssh refuses a readable key.
Tokens are never accepted on a command line or in a flag's value: only file paths are.

Lookups go through a SHA-256 of the presented token, so the table holds no token and the dict lookup time
says nothing about how many leading characters of a guess were right.
"""

from __future__ import annotations

import hashlib
import re

from kvstore.errors import ConfigError
from kvstore.security.files import check_private_file

__all__ = ["TokenTable", "read_client_token", "MIN_TOKEN_CHARS", "TENANT_RE"]

MIN_TOKEN_CHARS = 16
TENANT_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_TOKEN_RE = re.compile(r"^[\x21-\x7e]+$")  # printable ASCII, no spaces: it travels in an HTTP/2 header


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("ascii", "replace")).digest()


class TokenTable:
    """token -> tenant, loaded once at startup from an owner-only file."""

    def __init__(self, pairs: dict[bytes, str]) -> None:
        self._by_digest = pairs

    @classmethod
    def load(cls, path: str) -> TokenTable:
        check_private_file(path, "tokens_file")
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
        pairs: dict[bytes, str] = {}
        for n, line in enumerate(lines, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            parts = text.split()
            if len(parts) != 2:
                raise ConfigError(f"tokens_file {path}:{n}: expected `tenant token`, got {len(parts)} fields")
            tenant, token = parts
            if not TENANT_RE.match(tenant):
                raise ConfigError(f"tokens_file {path}:{n}: tenant {tenant!r} must match {TENANT_RE.pattern}")
            if len(token) < MIN_TOKEN_CHARS or not _TOKEN_RE.match(token):
                raise ConfigError(f"tokens_file {path}:{n}: the token of {tenant!r} must be at least "
                                  f"{MIN_TOKEN_CHARS} printable ASCII characters")
            d = _digest(token)
            if d in pairs and pairs[d] != tenant:
                raise ConfigError(f"tokens_file {path}:{n}: the same token is given to {pairs[d]!r} and {tenant!r}")
            pairs[d] = tenant
        if not pairs:
            raise ConfigError(f"tokens_file {path} holds no token: add `tenant token` lines or unset tokens_file")
        return cls(pairs)

    def tenant_of(self, token: str) -> str | None:
        return self._by_digest.get(_digest(token))

    @property
    def tenants(self) -> set[str]:
        return set(self._by_digest.values())


def read_client_token(path: str) -> str:
    """The token in a client's token file: the first non-comment line; `tenant token` lines are accepted too,
    so a tenant can be handed its own line of the daemon's file. Owner-only, like the daemon's."""
    check_private_file(path, "token_file")
    with open(path, encoding="utf-8") as fh:
        for line in fh.read().splitlines():
            text = line.split("#", 1)[0].strip()
            if text:
                token = text.split()[-1]
                if not _TOKEN_RE.match(token):
                    raise ConfigError(f"token_file {path}: the token must be printable ASCII without spaces")
                return token
    raise ConfigError(f"token_file {path} holds no token")
