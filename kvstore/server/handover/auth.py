"""Who may take a daemon's memory files through its hand-over socket.

The files are every tenant's blocks, so the bar is the daemon's own: a caller proves it holds what only a
daemon of this node holds, the whole tokens file (each tenant holds its own token, never the file), by
answering a random challenge with HMAC-SHA256 keyed by a digest of that file. Today's arena socket hands a
tenant only its own file after its token; a tenant that dials the hand-over socket gets no file at all
(tests/test_handover_attacks.py). Without tokens every process on the node is one tenant (docs/security.md):
the socket's owner-only directory and the peer's user id (SO_PEERCRED: this daemon's, or root) are the bar.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

from kvstore.errors import ConfigError

__all__ = ["handover_key", "proof", "proof_ok", "peer_allowed"]

_NO_TOKENS = b"kvstore-handover: no tokens file"


def handover_key(tokens_file: str) -> bytes:
    """The HMAC key: a digest of the tokens file's bytes as they are now (a daemon reading the same file, the
    same key), or a fixed key without tokens. ConfigError when the file cannot be read."""
    if not tokens_file:
        return hashlib.sha256(_NO_TOKENS).digest()
    try:
        with open(tokens_file, "rb") as fh:
            return hashlib.sha256(b"kvstore-handover\0" + fh.read()).digest()
    except OSError as exc:
        raise ConfigError(f"cannot read tokens_file {tokens_file} for the hand-over: {exc.strerror}") from exc


def proof(key: bytes, nonce: bytes) -> str:
    return hmac.new(key, b"kvstore-handover-proof\0" + nonce, hashlib.sha256).hexdigest()


def proof_ok(key: bytes, nonce: bytes, got: object) -> bool:
    return isinstance(got, str) and hmac.compare_digest(proof(key, nonce), got)


def peer_allowed(sock: socket.socket) -> tuple[bool, int]:
    """(whether the connected process runs as this daemon's user or root, its pid) by SO_PEERCRED."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", raw)
    return uid in (os.getuid(), 0), pid
