"""Copies this node holds of blocks it does not own: let them go, so a cluster's RAM holds each block once.

Without this a block lives at its writer, at its owner (the push) and at every node that read it (a fetch lands
in the reader's arena), each an ordinary LRU entry: a cluster of N nodes with C / N of RAM each then holds far
less than one node with C (bench.cluster, conversation trace, C = 0.2 of its unique blocks: 4 nodes reached
0.34-0.55 of one node's hit rate). A copy becomes a guest once its owner has it: the writer's copy after the
push lands, an old owner's copy after the hand-off, a reader's copy once the load that fetched it has leased it
(not before: the next batch landing for the same load would take it). What happens to a guest is
`peer_local_copies`:

    drop   (default) the RAM copy goes now (a disk copy stays): as an eviction would take it, or, when a reader
           holds it (the load that fetched it), hidden from every later lookup at once and freed when the reader
           lets go. Hidden, not just freed later: a lookup that counted it as here would then miss it. The
           cluster's RAM holds each block once, at its owner; a session's next turn on the same node reads the
           blocks it does not own from their owners again.
    guest  every guest is first to go (the engine's RELEASED class, Engine.let_go): it serves local hits until
           RAM is needed
    keep   an ordinary entry (before this existed)

An entry an agent's hint (Retain) or a pin marked is left as it is. bench.cluster measures the three.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.peer.change import MemberView
from kvstore.peer.counters import PeerCounters
from kvstore.peer.local import LocalStore
from kvstore.peer.placement import owners_of

__all__ = ["Guests", "LOCAL_COPIES"]

LOCAL_COPIES = ("drop", "guest", "keep")  # peer_local_copies


class Guests:
    def __init__(self, local: LocalStore, view: MemberView, counters: PeerCounters, mode: str = "drop") -> None:
        if mode not in LOCAL_COPIES:
            raise ValueError(f"peer_local_copies={mode!r}: use one of {', '.join(LOCAL_COPIES)}")
        self._local = local
        self._view = view
        self._counters = counters
        self.mode = mode

    def sent(self, namespace: str, keys: Sequence[bytes]) -> None:
        """`keys` (this node's puts, or blocks it handed over) are now at their owner(s)."""
        self._let_go(namespace, keys, drop=self.mode == "drop")

    def read(self, namespace: str, keys: Sequence[bytes]) -> None:
        """`keys` were fetched from their owners and a load has leased them."""
        self._let_go(namespace, keys, drop=self.mode == "drop")

    def _let_go(self, namespace: str, keys: Sequence[bytes], drop: bool) -> None:
        if self.mode == "keep" or not keys:
            return
        members = self._view.current()
        if len(members) < 2:
            return
        copies, me = max(1, self._view.copies), self._view.me
        guests = [k for k, o in zip(keys, owners_of(namespace, keys, members, copies)) if me not in o]
        if guests:
            self._counters.add("guest_copies", self._local.let_go(namespace, list(guests), drop))
