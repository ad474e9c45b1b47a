"""The peer protocol without I/O: what each side sends, what it accepts, and where received block bytes land.

The TCP plane (tcp_plane.py, tcp_server.py, tcp_blocks.py: sockets) and the UCX plane (ucx_plane.py: ucxx
messages on an asyncio loop) speak the same frames (frames.py). Everything about those frames that is not
moving bytes lives here, once, so the two planes cannot drift apart again (they had: a push reply's stored
count was bounded by the keys pushed on TCP only). No sockets, no event loop, no ucxx: a plane reads and
writes, this module decides.

    client (one call)                                    server (one request frame)
      req = fetch_request / probe_request / push_request   h = parse_request(raw header, limits)
      send req (header, then metadata)                     read h.meta_len bytes of metadata
      h = parse_reply(raw header, req.header, limits)      served = serve(h, meta, local, limits)
      read h.meta_len bytes of metadata                      Answer: send served.frame, then the leased
      fetch: plan = fetch_plan(h, meta, ns, keys, limits)      served.blocks (fetch); served.close()
             run the plan (below)                            Intake: run served.plan (below), then send
      probe: probe_result(h, meta) -> [held?]                  served.reply(blocks stored)
      push:  after sending the blocks, push_result(h) -> stored

    running a ReceivePlan: inc = plan.reserve(local)   (local.receive of the blocks it keeps)
      for (view, size) in plan.landing(inc): read `size` bytes into view (None: into scratch, dropped)
      then inc.finish(plan.checksums); a receive cut short at block j after `received` bytes leaves
      plan.left_after(j, received) bytes of the frame to drain

Hand-off (a PUSH with the HANDOFF flag, sent after a membership change: handoff.py): the receiver asks
`local.admit_handoff` which blocks it takes (those it owns; none when hand-offs arrive faster than its intake
budget) and reads the others into scratch; its reply counts what it stored, so the sender counts the rest as
not delivered.

Validation: every header, metadata section and reply is checked against the request it answers and the
limits before a byte more is read; a violation raises frames.FrameError saying what was wrong, and the plane
closes that connection or endpoint (a byte stream cannot be resynchronised). The checks of a reply:

    reply to   op            request id   count             meta_len       payload
    FETCH      FETCH_REPLY   the same     = keys asked      16 x count     = sum of the sizes in the metadata
    PROBE      PROBE_REPLY   the same     = keys asked      count          0        (the request's TIERS and CLAIM
                                                                                 flags echoed)
    PUSH       PUSH_REPLY    the same     <= blocks pushed  0              0
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvstore.engine.claims import check_claim
from kvstore.errors import InvalidRequestError
from kvstore.peer import frames as fr
from kvstore.peer.frames import FrameError, Header, NamespaceDesc
from kvstore.peer.local import Incoming, Outgoing

__all__ = ["Limits", "Frame", "LocalBlocks", "ReceivePlan", "Answer", "Intake", "REQUESTS", "REPLY_OF", "OP_NAMES",
           "fetch_request", "probe_request", "claim_request", "push_request", "parse_reply", "fetch_plan", "probe_result",
           "tiers_result", "claim_result",
           "push_result", "parse_request", "serve"]

REQUESTS = (fr.FETCH, fr.PUSH, fr.PROBE)
REPLY_OF = {fr.FETCH: fr.FETCH_REPLY, fr.PROBE: fr.PROBE_REPLY, fr.PUSH: fr.PUSH_REPLY}
OP_NAMES = {fr.FETCH: "fetch", fr.FETCH_REPLY: "fetch reply", fr.PUSH: "push", fr.PUSH_REPLY: "push reply",
            fr.PROBE: "probe", fr.PROBE_REPLY: "probe reply"}
_SIZE_ENTRY = 16  # bytes per key in a size table: size u64, xxh3 u64


@dataclass(frozen=True)
class Limits:
    """What a node accepts in one frame (peer_max_batch_keys, the engine's max_block_bytes)."""

    max_keys: int
    max_block_bytes: int


@dataclass(frozen=True)
class Frame:
    """A header and its metadata; block bytes, when the header counts any, follow them separately."""

    header: Header
    meta: bytes = b""

    def pack(self) -> bytes:
        """Header and metadata as one buffer (a stream transport sends them in one write)."""
        return self.header.pack() + self.meta


class LocalBlocks(Protocol):
    """What `serve` needs of the local store (local.LocalStore; a test passes a small in-memory fake)."""

    def open_for_send(self, namespace: str, keys: list[bytes]) -> Outgoing: ...

    def present(self, namespace: str, keys: list[bytes]) -> list[bool]: ...

    def tiers(self, namespace: str, keys: list[bytes]) -> list[int]: ...

    def claim(self, namespace: str, keys: list[bytes], claimant: bytes, ttl_ms: int) -> list[int]: ...

    def admit_handoff(self, namespace: str, keys: list[bytes], payload_bytes: int) -> list[bool]: ...

    def receive(self, namespace: str, keys: list[bytes], sizes: list[int],
                desc: NamespaceDesc | None = None) -> Incoming | None: ...


@dataclass(frozen=True)
class ReceivePlan:
    """The blocks that follow a fetch reply's or push's metadata: only keys with a size > 0 come on the wire,
    in key order, so `keys`, `sizes` and `checksums` hold those alone."""

    namespace: str
    keys: list[bytes]
    sizes: list[int]
    checksums: np.ndarray
    desc: NamespaceDesc | None = None  # a push's namespace description (the receiver may not know it yet)
    refused: frozenset[int] = frozenset()  # blocks (indexes into keys) read into scratch, never stored

    @classmethod
    def of(cls, namespace: str, keys: list[bytes], sizes: np.ndarray, checksums: np.ndarray,
           desc: NamespaceDesc | None = None) -> ReceivePlan:
        """The plan for a size table over `keys` (0 = this key sends no block)."""
        found = np.flatnonzero(sizes)
        return cls(namespace, [keys[i] for i in found.tolist()], [int(s) for s in sizes[found].tolist()],
                   checksums[found], desc)

    @property
    def payload_bytes(self) -> int:
        return sum(self.sizes)

    def reserve(self, local: LocalBlocks) -> Incoming | None:
        """Slots for the blocks this plan keeps (local.receive), as an Incoming over all of its blocks (None
        for a refused one: read and dropped); None when nothing is kept or nothing can be stored."""
        if not self.refused:
            return local.receive(self.namespace, self.keys, self.sizes, self.desc)
        kept = [i for i in range(len(self.keys)) if i not in self.refused]
        if not kept:
            return None
        inc = local.receive(self.namespace, [self.keys[i] for i in kept], [self.sizes[i] for i in kept], self.desc)
        if inc is not None:
            views: list[memoryview | None] = [None] * len(self.keys)
            for i, view in zip(kept, inc.views):
                views[i] = view
            inc.views = views
        return inc

    def landing(self, inc: Incoming | None) -> list[tuple[memoryview | None, int]]:
        """Per block on the wire: the reserved slot its bytes go into, or None (read into scratch and drop:
        no reservation at all, or a key already present or in flight), and its size."""
        if inc is None:
            return [(None, size) for size in self.sizes]
        if len(inc.views) != len(self.sizes):
            raise ValueError(f"{len(inc.views)} reserved slots for a plan of {len(self.sizes)} blocks")
        for view, size in zip(inc.views, self.sizes):
            if view is not None and len(view) != size:
                raise ValueError(f"a reserved slot of {len(view)} bytes for a block of {size}")
        return list(zip(inc.views, self.sizes))

    def left_after(self, block: int, received: int) -> int:
        """Bytes of the frame still to come when block `block` stopped after `received` of its bytes."""
        return self.sizes[block] - received + sum(self.sizes[block + 1:])


# -- client side ------------------------------------------------------------------------------------------
def fetch_request(request_id: int, namespace: str, keys: list[bytes]) -> Frame:
    meta = fr.encode_fetch(namespace, keys)
    return Frame(Header(fr.FETCH, request_id, len(keys), len(meta), 0), meta)


def probe_request(request_id: int, namespace: str, keys: list[bytes], tiers: bool = False) -> Frame:
    """`tiers`: ask for each key's tier (tiers_result) instead of whether it is held (probe_result)."""
    meta = fr.encode_fetch(namespace, keys)
    return Frame(Header(fr.PROBE, request_id, len(keys), len(meta), 0, fr.TIERS if tiers else 0), meta)


def claim_request(request_id: int, namespace: str, keys: list[bytes], claimant: bytes, ttl_ms: int) -> Frame:
    """A probe that also claims, at the member, the keys it misses (kvstore/engine/claims.py): claim_result."""
    meta = fr.encode_claim(namespace, keys, claimant, ttl_ms)
    return Frame(Header(fr.PROBE, request_id, len(keys), len(meta), 0, fr.CLAIM), meta)


def push_request(request_id: int, desc: NamespaceDesc, keys: list[bytes], sizes: np.ndarray,
                 checksums: np.ndarray, handoff: bool = False) -> Frame | None:
    """A push of the keys held locally (size > 0, e.g. local.Outgoing's sizes); None when none is (send
    nothing). The blocks follow the frame in key order. `handoff`: blocks handed to their new owner after a
    membership change (the receiver checks it owns each one)."""
    found = np.flatnonzero(sizes)
    if not len(found):
        return None
    meta = fr.encode_push(desc, [keys[i] for i in found.tolist()], sizes[found], checksums[found])
    return Frame(Header(fr.PUSH, request_id, len(found), len(meta), int(sizes[found].sum()),
                        fr.HANDOFF if handoff else 0), meta)


def parse_reply(raw: bytes, request: Header, limits: Limits) -> Header:
    """The reply header to `request`, checked as the module docstring's table says (the payload of a fetch
    reply against its size table later, in fetch_plan)."""
    if request.op not in REPLY_OF:
        raise ValueError(f"op {request.op} is not a request")
    op = REPLY_OF[request.op]
    h = fr.check_header(raw, max_keys=limits.max_keys, max_block_bytes=limits.max_block_bytes, expect=(op,))
    what = OP_NAMES[op]
    if h.request_id != request.request_id:
        raise FrameError(f"{what} for request {h.request_id}; expected request {request.request_id}")
    if op == fr.PUSH_REPLY:
        if h.count > request.count:
            raise FrameError(f"{what} says {h.count} blocks stored of the {request.count} pushed")
        if h.meta_len or h.payload_len:
            raise FrameError(f"a {what} carries no metadata or payload (got {h.meta_len} and {h.payload_len} bytes)")
        return h
    if h.count != request.count:
        raise FrameError(f"{what} with {h.count} keys for a request of {request.count}")
    entry = _SIZE_ENTRY if op == fr.FETCH_REPLY else 1
    if h.meta_len != entry * h.count:
        raise FrameError(f"{what} with {h.meta_len} bytes of metadata for {h.count} keys (expected {entry * h.count})")
    if op == fr.PROBE_REPLY and h.payload_len:
        raise FrameError(f"a {what} carries no payload (got {h.payload_len} bytes)")
    if op == fr.PROBE_REPLY and (h.flags & fr.CLAIM) != (request.flags & fr.CLAIM):
        raise FrameError(f"a {what} {'with' if h.flags & fr.CLAIM else 'without'} claim states to a probe "
                         f"{'with' if request.flags & fr.CLAIM else 'without'}")
    if op == fr.PROBE_REPLY and (h.flags & fr.TIERS) != (request.flags & fr.TIERS):
        raise FrameError(f"a {what} {'with' if h.flags & fr.TIERS else 'without'} tiers to a probe "
                         f"{'with' if request.flags & fr.TIERS else 'without'}")
    return h


def fetch_plan(reply: Header, meta: bytes, namespace: str, keys: list[bytes], limits: Limits) -> ReceivePlan:
    """Which of the fetched `keys` come back and their sizes, from a fetch reply's size table (checked: one
    entry per key, no block over the limit, sizes adding up to the header's payload)."""
    if len(keys) != reply.count:
        raise FrameError(f"fetch reply with {reply.count} keys for a request of {len(keys)}")
    sizes, sums = fr.decode_sizes(meta, reply.count, reply.payload_len, limits.max_block_bytes)
    return ReceivePlan.of(namespace, keys, sizes, sums)


def probe_result(reply: Header, meta: bytes) -> list[bool]:
    """Per key asked: whether the peer holds it (RAM or disk)."""
    return fr.decode_presence(meta, reply.count)


def tiers_result(reply: Header, meta: bytes) -> list[int]:
    """Per key asked: its tier at the peer (kvstore.vocab.Tier: NONE, RAM or DISK)."""
    return fr.decode_tiers(meta, reply.count)


def claim_result(reply: Header, meta: bytes) -> list[int]:
    """Per key asked: CLAIMED (now the caller's), HELD or PENDING (another's claim) at the peer (claims.py)."""
    return fr.decode_claim_states(meta, reply.count)


def push_result(reply: Header) -> int:
    """How many of the pushed blocks the peer stored (parse_reply bounded it by the blocks pushed)."""
    return reply.count


# -- server side ------------------------------------------------------------------------------------------
@dataclass
class Answer:
    """A fetch or probe served: send `frame`, then (fetch) every view of `blocks`, then close(), which
    releases the lease on the blocks (also when sending failed)."""

    frame: Frame
    blocks: Outgoing | None = None

    @property
    def served_blocks(self) -> int:
        return len(self.blocks.views) if self.blocks is not None else 0

    @property
    def payload_bytes(self) -> int:
        return self.frame.header.payload_len

    def close(self) -> None:
        if self.blocks is not None:
            self.blocks.close()


@dataclass(frozen=True)
class Intake:
    """A push to take in: run `plan` (its blocks follow the metadata), then send reply(blocks stored).
    `handoff`: a hand-off after a membership change (counted apart from the pushes that follow puts)."""

    request_id: int
    plan: ReceivePlan
    handoff: bool = False

    @property
    def counter(self) -> str:
        """The counter the blocks stored go to."""
        return "handoff_received" if self.handoff else "received_pushes"

    def reply(self, stored: int) -> Frame:
        if not 0 <= stored <= len(self.plan.keys):
            raise ValueError(f"{stored} blocks stored of a push of {len(self.plan.keys)}")
        return Frame(Header(fr.PUSH_REPLY, self.request_id, stored, 0, 0))


def _check_request(h: Header) -> None:
    if h.op not in REQUESTS:
        raise FrameError(f"op {h.op} is not a request (expected fetch, push or probe)")
    if h.op != fr.PUSH and h.payload_len:
        raise FrameError(f"a {OP_NAMES[h.op]} carries no payload (got {h.payload_len} bytes)")


def parse_request(raw: bytes, limits: Limits) -> Header:
    """A request header, checked before its metadata is read: format, limits, op, no payload on fetch/probe."""
    h = fr.check_header(raw, max_keys=limits.max_keys, max_block_bytes=limits.max_block_bytes, expect=REQUESTS)
    _check_request(h)
    return h


def serve(header: Header, meta: bytes, local: LocalBlocks, limits: Limits) -> Answer | Intake:
    """Dispatch one request against the local store. A fetch opens a lease on the blocks found (the caller
    sends them and closes the Answer); a probe asks which keys are held; a push touches nothing yet (the
    caller reserves slots when it runs the Intake's plan). Blocking: the local store's calls take the
    engine's lock (an event loop calls this in its executor)."""
    _check_request(header)
    if header.op == fr.PUSH:
        desc, keys, sizes, sums = fr.decode_push(meta, header.count, header.payload_len, limits.max_block_bytes)
        plan = ReceivePlan.of(desc.name, keys, sizes, sums, desc)
        if not header.flags & fr.HANDOFF:
            return Intake(header.request_id, plan)
        admitted = local.admit_handoff(desc.name, plan.keys, plan.payload_bytes)
        refused = frozenset(i for i, ok in enumerate(admitted) if not ok)
        return Intake(header.request_id, dataclasses.replace(plan, refused=refused), handoff=True)
    if header.op == fr.PROBE and header.flags & fr.CLAIM:
        namespace, keys, claimant, ttl_ms = fr.decode_claim(meta, header.count)
        try:
            check_claim(claimant, ttl_ms)
        except InvalidRequestError as exc:
            raise FrameError(str(exc)) from exc
        table = bytes(local.claim(namespace, keys, claimant, ttl_ms))
        return Answer(Frame(Header(fr.PROBE_REPLY, header.request_id, header.count, len(table), 0, fr.CLAIM), table))
    namespace, keys = fr.decode_fetch(meta, header.count)
    if header.op == fr.PROBE and header.flags & fr.TIERS:
        table = fr.encode_tiers(local.tiers(namespace, keys))
        return Answer(Frame(Header(fr.PROBE_REPLY, header.request_id, header.count, len(table), 0, fr.TIERS), table))
    if header.op == fr.PROBE:
        table = fr.encode_presence(local.present(namespace, keys))
        return Answer(Frame(Header(fr.PROBE_REPLY, header.request_id, header.count, len(table), 0), table))
    out = local.open_for_send(namespace, keys)
    try:
        table = fr.encode_sizes(out.sizes, out.checksums)
        return Answer(Frame(Header(fr.FETCH_REPLY, header.request_id, header.count, len(table),
                                   out.payload_bytes), table), out)
    except BaseException:
        out.close()
        raise
