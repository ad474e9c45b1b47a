"""Block payloads on the TCP plane: received straight into reserved arena slots, sent straight from leased ones.
Which bytes land in which slot is the protocol's ReceivePlan (protocol.py); this file only moves them.

Both ends of a transfer are bounded twice: by the frame's (or call's) deadline, and by the safe end of the
reservation or lease the slots belong to (local.py `live_until`). The second bound is the one that protects
other blocks: a slot whose reservation expired goes to quarantine and then to a new owner, so no byte may be
written into it after that point, however slowly the peer sends.

- receive: when the reservation's safe end comes before the frame's deadline, the reservation is aborted
  at once (`slot_deadline_exceeded`) and the rest of the frame is read into scratch under the frame's
  deadline, so the connection stays in step. When the frame's deadline fires, the reservation is aborted
  and DeadlineExceeded goes up (the caller closes the connection). Aborting is safe only because this
  thread is the one that wrote into the slots and has returned from its last recv_into.
- send: past the lease's safe end the slot may be evicted and reused, so a send that would run past it
  fails like a missed deadline (the receiver sees a short frame, a miss).
"""

from __future__ import annotations

import logging
import socket

from kvstore.peer.counters import PeerCounters
from kvstore.peer.deadline import Deadline, DeadlineExceeded
from kvstore.peer.local import LocalStore, Outgoing
from kvstore.peer.protocol import ReceivePlan
from kvstore.peer.sockio import drain, recv_into_exact, send_all

__all__ = ["receive_blocks", "send_blocks"]

log = logging.getLogger(__name__)


def receive_blocks(sock: socket.socket, local: LocalStore, counters: PeerCounters, plan: ReceivePlan,
                   frame: Deadline) -> int:
    """Read the blocks of a reply or push (protocol.ReceivePlan) into reserved slots, verify, commit; the
    number of blocks stored here."""
    if not plan.sizes:
        return 0
    inc = plan.reserve(local)
    if inc is None:
        drain(sock, plan.payload_bytes, frame)
        return 0
    slots = frame.until(inc.live_until, "receive into reserved slots")
    try:
        for j, (view, size) in enumerate(plan.landing(inc)):
            if view is None:
                drain(sock, size, frame)
                continue
            try:
                recv_into_exact(sock, view, slots)
                inc.landed(j)  # hashed while hot; the sender keeps filling the socket meanwhile
            except DeadlineExceeded as exc:
                if exc.deadline is frame:
                    raise
                inc.abort()  # before the reservation can expire: its slots are free again, none written later
                counters.add("slot_deadline_exceeded")
                log.warning("peer frame for %d blocks still arriving at its reservation's safe end: aborted, "
                            "rest drained (raise reservation_ttl_s or lower peer_timeout_s)", len(plan.keys))
                drain(sock, plan.left_after(j, exc.received), frame)
                return 0
    except BaseException:
        inc.abort()
        raise
    return inc.finish(plan.checksums)


def send_blocks(sock: socket.socket, out: Outgoing, frame: Deadline) -> None:
    """Send every found block from its leased slot, within the frame's deadline and the lease's safe end."""
    bound = frame.until(out.live_until, "send from leased slots")
    for view in out.views:
        send_all(sock, view, bound)
