"""Random and malformed frames for the same-node fast path (kvstore/fastpath/protocol.py), for the fuzz test.

Frames lean towards what reaches deep code: well-formed requests over registered namespaces, known keys and ids
the daemon just issued, sizes at the limits; and otherwise anything: truncated or padded bodies, lying counts,
random bytes, unknown ops, a second HELLO, a frame cut off by the client closing mid-way. The daemon may answer
any error, but never `internal` (a bug), and it closes a connection only after an error flagged CLOSING (or when
the client itself went away mid-frame).
"""

from __future__ import annotations

import socket
import struct

from kvstore.fastpath import protocol as fp
from kvstore.fastpath import spare_bodies as sb
from kvstore.testing.fuzz import FuzzStats, Pools, Source

__all__ = ["FastFuzzer"]

_OPS = (fp.LOOKUP, fp.RESERVE, fp.COMMIT, fp.ABORT, fp.RELEASE, fp.EXISTS, fp.ECHO, fp.HELLO, fp.PROBE,
        fp.LOOKUP_IDS, fp.HITS, fp.SPARE, fp.STORE)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise ConnectionError("closed")
        buf += got
    return buf


class FastFuzzer:
    """One fuzzing connection to the daemon's fast-path socket, re-dialled when the daemon closes it."""

    def __init__(self, path: str, token: str = "") -> None:
        self.path = path
        self.token = token
        self.sock: socket.socket | None = None
        self.unexpected_closes: list[str] = []  # closed without a CLOSING error: a bug

    def _conn(self) -> socket.socket:
        if self.sock is None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(self.path)
            s.sendall(fp.frame(fp.HELLO, fp.encode_hello(self.token, False)))
            head = fp.Header.parse(_recv_exact(s, fp.HEADER.size))
            _recv_exact(s, head.length)
            if head.status != fp.OK:
                raise RuntimeError("the fuzzer's HELLO was refused")
            self.sock = s
        return self.sock

    def _drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def close(self) -> None:
        self._drop()

    # -- one frame ----------------------------------------------------------------------------------------
    def step(self, src: Source, pools: Pools, stats: FuzzStats) -> None:
        op = src.choice(_OPS)
        body = self._body(op, src, pools)
        mutation = src.int(0, 9)
        flags = src.int(0, 7) if op in (fp.LOOKUP, fp.LOOKUP_IDS, fp.HITS) else src.int(0, 1) * src.int(0, 255)
        if mutation == 0 and body:
            body = body[: src.int(0, len(body) - 1)]          # truncated body
        elif mutation == 1:
            body = body + src.bytes(16)                        # junk after the body
        elif mutation == 2:
            body = src.bytes(200)                              # anything
        elif mutation == 3:
            op = src.int(0, 255)                               # maybe an unknown op
        stats.calls[f"fast:{fp.OP_NAMES.get(op, 'unknown')}"] += 1
        sock = self._conn()
        rid = src.int(0, 2**32 - 1)
        if mutation == 4:  # the client dies mid-frame: header promises more than it sends
            sock.sendall(fp.HEADER.pack(len(body) + 10, op, flags, 0, rid) + body)
            self._drop()
            stats.codes["fast:client_gone"] += 1
            return
        # a one-way request gets no reply: an ECHO behind it says it was read (or its error comes first)
        sync = fp.frame(fp.ECHO, b"", rid ^ 1) if op in fp.ONE_WAY else b""
        sock.sendall(fp.HEADER.pack(len(body), op, flags, 0, rid) + body + sync)
        try:
            head = fp.Header.parse(_recv_exact(sock, fp.HEADER.size))
            reply = _recv_exact(sock, head.length)
        except (ConnectionError, OSError, fp.FrameError) as exc:
            self.unexpected_closes.append(f"op {op} mutation {mutation}: {exc}")
            self._drop()
            return
        if head.status == fp.OK and sync:
            stats.codes["fast:one_way_ok" if head.request_id == rid ^ 1 else "fast:one_way_answered"] += 1
            if head.request_id != rid ^ 1:  # a reply to a one-way request: the stream is out of step
                stats.internal.append(f"fast op {op} mutation {mutation}: a one-way request was answered")
                self._drop()
        elif head.status == fp.OK:
            stats.codes["fast:ok"] += 1
            self._remember(op, reply, pools)
        else:
            reason, message = fp.decode_error(reply)
            stats.codes[f"fast:{reason}"] += 1
            if reason == "internal":
                stats.internal.append(f"fast op {op} mutation {mutation}: {message}")
        if head.flags & fp.CLOSING:
            self._drop()

    @staticmethod
    def _body(op: int, src: Source, pools: Pools) -> bytes:
        def ns() -> str:
            return src.choice(pools.namespaces) if src.int(0, 9) < 8 else src.text(20)

        def keys() -> list[bytes]:
            return [src.choice(pools.keys) if src.int(0, 9) < 8 else src.bytes(70) for _ in range(src.int(0, 6))]

        def rid(pool: list[int]) -> int:
            # the same draws whatever the pool holds: hypothesis replays draws and needs their shape to repeat
            anything, use, idx = src.int(0, 2**64 - 1), src.int(0, 2), src.int(0, 63)
            return pool[idx % len(pool)] if use and pool else anything

        try:
            if op in (fp.LOOKUP, fp.EXISTS):
                return fp.encode_lookup(ns(), keys())
            if op == fp.RESERVE:
                ks = keys()
                sizes = [src.choice([1, 4096, pools.max_block_bytes, pools.max_block_bytes + 1, 0, 2**64 - 1])
                         for _ in ks]
                return fp.encode_reserve(ns(), ks, sizes)
            if op == fp.COMMIT:
                return fp.encode_commit(rid(pools.reservation_ids), [src.int(0, 2**64 - 1)
                                                                     for _ in range(src.int(0, 2))])
            if op == fp.ABORT:
                return fp.encode_u64(rid(pools.reservation_ids))
            if op == fp.RELEASE:
                return fp.encode_release([rid(pools.lease_ids) for _ in range(src.int(0, 3))])
            if op == fp.HELLO:
                return fp.encode_hello(src.text(10), bool(src.int(0, 1)))
            if op == fp.SPARE:
                return sb.encode_spare(src.choice([1, 4096, pools.max_block_bytes, pools.max_block_bytes + 1, 0,
                                                   2**64 - 1]), src.choice([0, 1, 3, 64, 65, 2**32 - 1]))
            if op == fp.STORE:  # slots this connection was granted (or another's, gone, or never issued)
                ks = keys()
                sizes = [src.choice([1, 4096, pools.max_block_bytes, 0]) for _ in ks]
                return sb.encode_store(ns(), ks, sizes, [rid(pools.spare_slots) for _ in ks])
            if op in (fp.PROBE, fp.LOOKUP_IDS, fp.HITS):  # entry ids and serials a client could not have found
                m = src.int(0, 6)
                ids = b"".join(src.int(0, 2**32 - 1 if src.int(0, 3) == 0 else 64).to_bytes(4, "little")
                               for _ in range(m))
                serials = b"".join(src.int(0, 2**32 - 1).to_bytes(4, "little") for _ in range(m))
                # a HITS may carry the keys after its entries too (a short probe answered from the index)
                tail = op == fp.PROBE or (op == fp.HITS and src.int(0, 1) == 1)
                return fp.encode_probe(ns(), ids, serials, keys() if tail else ())
        except fp.FrameError:
            pass
        return src.bytes(64)

    @staticmethod
    def _remember(op: int, reply: bytes, pools: Pools) -> None:
        try:
            if op == fp.RESERVE:
                pools.remember(pools.reservation_ids, fp.decode_reserve_reply(reply)[0])
            elif op == fp.LOOKUP:
                pools.remember(pools.lease_ids, fp.decode_lookup_reply(reply).lease_id)
            elif op in (fp.SPARE, fp.STORE):
                for off in (sb.decode_spare_reply(reply)[1] if op == fp.SPARE else sb.decode_store_reply(reply)[2]):
                    pools.remember(pools.spare_slots, off)
        except (fp.FrameError, struct.error):
            pass
