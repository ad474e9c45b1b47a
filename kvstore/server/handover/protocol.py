"""The hand-over wire: messages between a running daemon and its successor on `<unix_socket>.handover`.

A message is a fixed header, a JSON body, then raw blobs (numpy arrays the body names), with file descriptors
(SCM_RIGHTS) riding on its first bytes::

    magic "KVHO" | format u16 | kind u16 | descriptors u32 | body bytes u64 | blob bytes u64 | body | blobs

Nothing is pickled: the body is JSON checked field by field by its reader (codec.py), the blobs are arrays of a
dtype the body states and the reader allows. Bounds: body <= 64 MiB, blobs <= 1 GiB, <= 250 descriptors
(SCM_MAX_FD is 253). A message that breaks them, or a format other than FORMAT, is a HandoverError: the side
that reads it stops the hand-over (the old daemon keeps serving; the successor starts cold).

The conversation (sender = the running daemon, receiver = its successor)::

    receiver                               sender
    HELLO {format, version, pid}  ------->
                                  <------- CHALLENGE {nonce}
    PROOF {hmac}                  ------->                      (auth.py: who may take the files)
                                  <------- OFFER {layout, ...} + journal, arena files, key index tables
    ACCEPT | DECLINE {why}        ------->                      (DECLINE: the sender shuts down as on SIGTERM,
                                                                 the receiver starts cold)
                                  <------- PREPARED {records}   (journal written, every block hashed; serving)
    VERIFIED {blocks}             ------->                      (the receiver hashed them, outside the window)
                                  <------- FROZEN {live state} + the same-node socket's listener
    READY {blocks}                ------->                      (adopted and verified again: ready to serve)
                                  <------- COMMIT | ABORT
    SERVING                       ------->                      (its sockets are the paths' now)
                                           (exits without closing what it handed over)

Either side may send ERROR {why} instead of its next message; an EOF anywhere means the other side is gone.
HELLO, CHALLENGE, PROOF, DECLINE and ERROR keep their shape in every format (PROLOGUE): a successor of another
format proves itself first, and only then is told to start cold (the old daemon then stops as on SIGTERM).
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["FORMAT", "Kind", "Message", "HandoverError", "PeerGone", "Refused", "send", "recv", "expect",
           "handover_socket_path"]

FORMAT = 1
_HEADER = struct.Struct("<4sHHIQQ")
_MAGIC = b"KVHO"
MAX_BODY = 64 << 20
MAX_BLOBS = 1 << 30
MAX_FDS = 250
_DTYPES = {"<u8", "<i8", "<u4", "|u1", "<f8"}


class Kind:
    HELLO, CHALLENGE, PROOF, OFFER, ACCEPT, DECLINE, PREPARED, VERIFIED, FROZEN, READY, COMMIT, ABORT, ERROR, \
        SERVING = range(1, 15)
    NAMES = {1: "HELLO", 2: "CHALLENGE", 3: "PROOF", 4: "OFFER", 5: "ACCEPT", 6: "DECLINE", 7: "PREPARED",
             8: "VERIFIED", 9: "FROZEN", 10: "READY", 11: "COMMIT", 12: "ABORT", 13: "ERROR", 14: "SERVING"}


# read in any format: a daemon and a successor of another version still authenticate each other and agree to
# part (the old one shuts down, the new one starts cold) instead of failing on the first byte
PROLOGUE = (Kind.HELLO, Kind.CHALLENGE, Kind.PROOF, Kind.ERROR, Kind.DECLINE)


class HandoverError(Exception):
    """The hand-over cannot go on (a malformed or unexpected message, a timeout): the message says why."""


class PeerGone(HandoverError):
    """The other side's end closed with no word: its process is gone (a daemon answers every refusal)."""


class Refused(HandoverError):
    """The other side said ERROR or ABORT: it goes on as it was (a running daemon keeps serving)."""


@dataclass
class Message:
    kind: int
    body: dict[str, Any] = field(default_factory=dict)
    blobs: dict[str, np.ndarray] = field(default_factory=dict)
    fds: list[int] = field(default_factory=list)
    format: int = FORMAT

    @property
    def name(self) -> str:
        return Kind.NAMES.get(self.kind, str(self.kind))

    def close_fds(self) -> None:
        import os
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


def handover_socket_path(unix_socket: str) -> str:
    """Where a daemon waits for its successor: beside its gRPC socket (same 0700 directory)."""
    return unix_socket + ".handover" if unix_socket else ""


def send(sock: socket.socket, kind: int, body: dict[str, Any] | None = None,
         blobs: dict[str, np.ndarray] | None = None, fds: list[int] | None = None, fmt: int = FORMAT) -> None:
    """One message (HandoverError when the other side is gone). `fmt`: only tests speak another format."""
    blobs = blobs or {}
    fds = fds or []
    index, parts = [], []
    for name, arr in blobs.items():
        a = np.ascontiguousarray(arr)
        if a.dtype.str not in _DTYPES:
            raise ValueError(f"blob {name!r} of dtype {a.dtype.str} cannot be sent")
        index.append([name, a.dtype.str, int(a.size)])
        parts.append(a.tobytes())
    raw = json.dumps({**(body or {}), "_blobs": index}).encode()
    payload = b"".join(parts)
    if len(raw) > MAX_BODY or len(payload) > MAX_BLOBS or len(fds) > MAX_FDS:
        raise HandoverError(f"hand-over message {Kind.NAMES.get(kind)} too large ({len(raw)} + {len(payload)} bytes, "
                            f"{len(fds)} descriptors)")
    data = _HEADER.pack(_MAGIC, fmt, kind, len(fds), len(raw), len(payload)) + raw + payload
    try:
        sent = socket.send_fds(sock, [data], fds) if fds else sock.send(data)
        if sent < len(data):
            sock.sendall(memoryview(data)[sent:])
    except TimeoutError as exc:
        raise HandoverError(f"the other side of the hand-over does not read ({exc})") from exc
    except OSError as exc:
        raise PeerGone(f"the other side of the hand-over is gone ({exc})") from exc


def recv(sock: socket.socket) -> Message:
    """The next message; HandoverError for EOF, a malformed message or another format (descriptors that came
    with a bad message are closed)."""
    try:
        head, fds, flags, _ = socket.recv_fds(sock, _HEADER.size, MAX_FDS)
    except TimeoutError as exc:
        raise HandoverError(f"no word from the other side of the hand-over in time ({exc})") from exc
    except OSError as exc:
        raise PeerGone(f"the other side of the hand-over is gone ({exc})") from exc
    msg = Message(0, fds=list(fds))
    try:
        if not head:
            raise PeerGone("the other side of the hand-over closed the connection")
        if flags & socket.MSG_CTRUNC:
            raise HandoverError("descriptors of a hand-over message were cut off")
        head += _exact(sock, _HEADER.size - len(head))
        magic, fmt, kind, n_fds, body_len, blob_len = _HEADER.unpack(head)
        if magic != _MAGIC:
            raise HandoverError("not a kvstore hand-over message")
        msg.format = fmt
        if fmt != FORMAT and kind not in PROLOGUE:
            raise HandoverError(f"hand-over format {fmt}, this daemon speaks {FORMAT}")
        if kind not in Kind.NAMES or n_fds != len(fds) or body_len > MAX_BODY or blob_len > MAX_BLOBS:
            raise HandoverError(f"malformed hand-over message (kind {kind}, {len(fds)} of {n_fds} descriptors, "
                                f"{body_len} + {blob_len} bytes)")
        msg.kind = kind
        body = json.loads(_exact(sock, body_len))
        if not isinstance(body, dict) or not isinstance(body.get("_blobs"), list):
            raise HandoverError("malformed hand-over message body")
        payload = _exact(sock, blob_len)
        msg.blobs = _blobs(body.pop("_blobs"), payload)
        msg.body = body
        return msg
    except (HandoverError, ValueError, TypeError) as exc:
        msg.close_fds()
        raise exc if isinstance(exc, HandoverError) else HandoverError(f"malformed hand-over message: {exc}") from exc


def _blobs(index: list[Any], payload: bytes) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    at = 0
    for item in index:
        name, dtype, count = item
        if not isinstance(name, str) or dtype not in _DTYPES or not isinstance(count, int) or count < 0:
            raise HandoverError(f"malformed blob entry {item!r}")
        dt = np.dtype(dtype)
        end = at + count * dt.itemsize
        if end > len(payload):
            raise HandoverError(f"blob {name!r} runs past the message")
        out[name] = np.frombuffer(payload, dtype=dt, count=count, offset=at).copy()
        at = end
    if at != len(payload):
        raise HandoverError("hand-over message has bytes no blob names")
    return out


def _exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        try:
            part = sock.recv(min(n - got, 1 << 20))
        except TimeoutError as exc:
            raise HandoverError(f"a hand-over message stopped half-way ({exc})") from exc
        except OSError as exc:
            raise PeerGone(f"the other side of the hand-over is gone ({exc})") from exc
        if not part:
            raise PeerGone("the other side of the hand-over closed the connection mid-message")
        chunks.append(part)
        got += len(part)
    return b"".join(chunks)


def expect(msg: Message, *kinds: int) -> Message:
    """`msg` if it is one of `kinds`; else HandoverError (an ERROR message's reason, or what came instead)."""
    if msg.kind in kinds:
        return msg
    msg.close_fds()
    if msg.kind in (Kind.ERROR, Kind.ABORT):
        raise Refused(f"the other side stopped the hand-over: {msg.body.get('why', '?')}")
    raise HandoverError(f"expected {'/'.join(Kind.NAMES[k] for k in kinds)}, got {msg.name}")
