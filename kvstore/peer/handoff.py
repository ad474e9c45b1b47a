"""Hand-off: after a membership change, move the blocks this node holds to their new owners.

    schedule(change)   the membership watch saw a change (change.MemberChange): queue a pass over this node's
                       blocks. A change that arrives during a pass ends it; the next pass covers both changes
                       at once (MemberChange.compose), so a burst of joins is one walk, not one per join.
    leave(deadline)    this node is leaving (SIGTERM, a rolling update): one pass with this node taken out of
                       the member set, in the caller's thread, until it is done or the deadline passes; the
                       daemon then revokes its lease. Its blocks are at their next owners before peers stop
                       routing to it.
    pending            passes queued or running (0: every change seen so far has been handed off)
    settled(after)     the callback once this node has handed off everything for the member set `after`: a
                       pass that finished with nothing left undelivered, then `settle_grace_s` (pushes and
                       hand-offs already on the wire to this node land meanwhile, and so do pushes of writers
                       that saw the change after this node), then a catch-up pass over the keys that arrived
                       since the walk, also complete. A newer change or a stop during any of it: no callback
                       (the newer change's pass settles instead). PeerCluster publishes it (change.py).

A pass walks every key held here (RAM and disk; Engine.held_keys) and asks placement.handoff_targets which new
owners this node must give it to (the keys this node owned, or whose owners all left). Keys go out in batches
of `batch_keys` per (target, namespace): first a metadata-only probe (the target may hold some already: a
replica, another holder's hand-off, a put that reached it), then one push with the HANDOFF flag for the rest;
the target takes only blocks it owns (intake.py). Bytes go out through a token bucket of `bytes_per_s`
(peer_handoff_bytes_per_s), so a hand-off never takes the data plane from the reads that serve requests.

Nothing here is a correctness path: a block whose hand-off fails (target down, timeout, refused) stays where it
is, unsettled, and reads find it there through the previous owners for the hand-off window (change.MemberView).
Counted: handoff_scans, handoff_catch_ups, handoff_settles, handoff_keys_scanned, handoff_blocks (stored at the
target), handoff_bytes (sent), handoff_present (already there), handoff_dropped (not delivered).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.peer.change import MemberChange
from kvstore.peer.counters import PeerCounters
from kvstore.peer.intake import TokenBucket
from kvstore.peer.local import LocalStore
from kvstore.peer.membership import Member
from kvstore.peer.placement import handoff_targets_of
from kvstore.peer.plane import DataPlane, PeerCallError

__all__ = ["HandOff", "PassReport"]

log = logging.getLogger(__name__)


@dataclass
class PassReport:
    """What one pass did (also added to the counters)."""

    change: str = ""
    scanned: int = 0
    sent: int = 0          # blocks stored at their new owner
    sent_bytes: int = 0
    present: int = 0       # already at the new owner
    dropped: int = 0       # not delivered
    finished: bool = True  # False: cut short by a newer change, a stop or the deadline
    seconds: float = 0.0


class _Cut(Exception):
    """The pass must end now (a newer change, a stop, a deadline)."""


class HandOff:
    def __init__(self, local: LocalStore, plane: DataPlane, members: Callable[[], dict[str, Member]], me: str, *,
                 copies: int, bytes_per_s: float, counters: PeerCounters, batch_keys: int = 32,
                 landed: Callable[[str, list[bytes]], None] = lambda ns, keys: None,
                 settled: Callable[[frozenset[str]], None] = lambda after: None,
                 settle_grace_s: float = 1.0) -> None:
        self._local = local
        self._plane = plane
        self._members = members
        self._me = me
        self._copies = copies
        self._bucket = TokenBucket(bytes_per_s)
        self._counters = counters
        self._batch = batch_keys
        self._landed = landed  # keys now at their new owner (guests.py lets go of this node's copy)
        self._settled = settled
        self._grace = settle_grace_s
        self._cond = threading.Condition()
        self._pending: MemberChange | None = None
        self._generation = 0      # bumped by every schedule(): a running pass stops when it moves
        self._running = False
        self._stopping = False
        self.last: PassReport | None = None
        self._thread = threading.Thread(target=self._loop, name="kvstore-handoff", daemon=True)

    # -- life cycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._copies:
            self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    @property
    def pending(self) -> int:
        with self._cond:
            return int(self._pending is not None) + int(self._running)

    def schedule(self, change: MemberChange) -> None:
        """Queue a pass for this change (composed with one not yet run). Never blocks."""
        if not self._copies:
            return
        with self._cond:
            self._pending = change if self._pending is None else self._pending.compose(change)
            self._generation += 1
            self._cond.notify_all()

    def leave(self, members: frozenset[str], deadline_s: float, grace_s: float = 0.0) -> PassReport:
        """Hand every block this node owns to its owner in `members` less this node, within deadline_s: after
        `grace_s` (pushes already on the wire land), one pass over what it holds, then passes over what arrived
        during the last one, until nothing new did. The background thread is stopped first (what it had queued
        is moot once this node leaves)."""
        self.stop()
        end = time.monotonic() + deadline_s
        time.sleep(max(0.0, min(grace_s, deadline_s / 4)))
        change = MemberChange(members, members - {self._me})
        seen: dict[str, set[bytes]] = {}
        report = self._pass(change, lambda: time.monotonic() > end, seen)
        for _ in range(3):
            if not report.finished:
                break
            more = self._pass(change, lambda: time.monotonic() > end, seen)
            report = _merged(report, more)
            if not more.scanned:
                break
        log.info("leave hand-off: %d blocks handed over (%d bytes), %d already there, %d not delivered, in %.2fs%s",
                 report.sent, report.sent_bytes, report.present, report.dropped, report.seconds,
                 "" if report.finished else " (peer_leave_timeout_s reached: the rest leaves with this node)")
        return report

    # -- the background thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._stopping:
                    self._cond.wait()
                if self._stopping or self._pending is None:
                    return
                change, self._pending = self._pending, None
                generation = self._generation
                cut = self._superseded(generation)
                self._running = True
            seen: dict[str, set[bytes]] = {}
            broke = False
            try:
                report = self._pass(change, cut, seen)
            except Exception:  # the hand-off thread must outlive a bug in one pass
                log.exception("hand-off pass failed")
                report, broke = PassReport(change.describe(), finished=True), True  # finished, never settled
            with self._cond:
                self._running = False
                if not report.finished and not self._stopping:  # a newer change: one pass covers both
                    self._pending = change if self._pending is None else change.compose(self._pending)
            self.last = report
            if report.finished:
                log.info("hand-off after %s: %d blocks handed over (%d bytes), %d already there, "
                         "%d not delivered, %d keys looked at, %.2fs", report.change, report.sent,
                         report.sent_bytes, report.present, report.dropped, report.scanned, report.seconds)
                if not report.dropped and not broke:
                    self._settle(change, generation, seen)

    def _settle(self, change: MemberChange, generation: int, seen: dict[str, set[bytes]]) -> None:
        """After a complete pass: the grace, the catch-up pass, then `settled` unless anything moved meanwhile. A
        newer change during them takes this one along (composed, as a cut pass does): a block that arrived in
        the grace, which this node must hand on under this change, is then still its to hand on."""
        cut = self._superseded(generation)
        with self._cond:
            if self._cond.wait_for(cut, timeout=self._grace):
                self._requeue(change)
                return
            self._running = True
        try:
            report = self._pass(change, cut, seen, catch_up=True)
        except Exception:
            log.exception("hand-off catch-up pass failed")
            return
        finally:
            with self._cond:
                self._running = False
        if report.scanned:
            log.info("hand-off catch-up after %s: %d blocks that arrived meanwhile handed over, %d not delivered",
                     report.change, report.sent, report.dropped)
        if not report.finished or cut():
            with self._cond:
                self._requeue(change)
            return
        if not report.dropped:
            self._counters.add("handoff_settles")
            try:
                self._settled(change.after)
            except Exception:  # the hand-off thread must outlive a bug in the callback
                log.exception("publishing the settle failed")

    def _requeue(self, change: MemberChange) -> None:
        """Under _cond: `change` again, before the newer one queued (the next pass covers both)."""
        if not self._stopping:
            self._pending = change if self._pending is None else change.compose(self._pending)

    def _superseded(self, generation: int) -> Callable[[], bool]:
        """The cut test of a pass started at `generation`: a newer change, or a stop, ends it."""
        return lambda: self._generation != generation or self._stopping

    # -- one pass ------------------------------------------------------------------------------------------
    def _pass(self, change: MemberChange, cut: Callable[[], bool],
              seen: dict[str, set[bytes]] | None = None, catch_up: bool = False) -> PassReport:
        """One walk over the keys held here (with `seen`: only those not in it, which it then records); a
        settling catch-up is counted as `handoff_catch_ups`, not as a scan."""
        start = time.monotonic()
        report = PassReport(change.describe())
        self._counters.add("handoff_catch_ups" if catch_up else "handoff_scans")
        members = self._members()
        try:
            for namespace in self._local.namespaces():
                keys = self._local.held(namespace)
                if seen is not None:
                    done = seen.setdefault(namespace, set())
                    keys = [k for k in keys if k not in done]
                    done.update(keys)
                self._namespace(namespace, keys, change, members, report, cut)
        except _Cut:
            report.finished = False
        report.seconds = time.monotonic() - start
        return report

    def _namespace(self, namespace: str, keys: list[bytes], change: MemberChange, members: dict[str, Member],
                   report: PassReport, cut: Callable[[], bool]) -> None:
        report.scanned += len(keys)
        self._counters.add("handoff_keys_scanned", len(keys))
        batches: dict[str, list[bytes]] = {}
        for lo in range(0, len(keys), 1024):
            if cut():
                raise _Cut
            part = keys[lo:lo + 1024]
            for key, targets in zip(part, handoff_targets_of(namespace, part, change.before, change.after,
                                                             self._copies, self._me, change.via)):
                for target in targets:
                    batch = batches.setdefault(target, [])
                    batch.append(key)
                    if len(batch) >= self._batch:
                        self._send(members.get(target), namespace, batch, report, cut)
                        batches[target] = []
        for target, batch in batches.items():
            if batch:
                self._send(members.get(target), namespace, batch, report, cut)

    def _send(self, member: Member | None, namespace: str, keys: list[bytes], report: PassReport,
              cut: Callable[[], bool]) -> None:
        """Probe the target, then push what it lacks (HANDOFF), within the byte budget."""
        if member is None:  # left again since the change: the next pass routes these elsewhere
            self._dropped(report, len(keys))
            return
        try:
            present = self._plane.probe(member, namespace, keys)
        except PeerCallError as exc:
            log.info("hand-off probe of %d keys to %s failed: %s", len(keys), member.node_id, exc)
            self._dropped(report, len(keys))
            return
        missing = [k for k, p in zip(keys, present) if not p]
        already = len(keys) - len(missing)
        if already:
            self._landed(namespace, [k for k, p in zip(keys, present) if p])
        report.present += already
        self._counters.add("handoff_present", already)
        sizes = self._local.sizes(namespace, missing)
        missing = [k for k in missing if k in sizes]  # evicted here since the walk: nothing to send
        if not missing:
            return
        nbytes = sum(sizes[k] for k in missing)
        while not self._bucket.try_take(nbytes):
            if cut():
                self._dropped(report, len(missing))
                raise _Cut
            time.sleep(min(0.05, self._bucket.wait_time()))
        try:
            stored = self._plane.push(member, self._local.describe(namespace), missing, handoff=True)
        except PeerCallError as exc:
            log.info("hand-off of %d blocks to %s failed: %s", len(missing), member.node_id, exc)
            self._dropped(report, len(missing))
            return
        report.sent += stored
        report.sent_bytes += nbytes
        if stored == len(missing):
            self._landed(namespace, missing)
        self._counters.add("handoff_blocks", stored)
        self._counters.add("handoff_bytes", nbytes)
        self._dropped(report, len(missing) - stored)

    def _dropped(self, report: PassReport, n: int) -> None:
        if n:
            report.dropped += n
            self._counters.add("handoff_dropped", n)


def _merged(a: PassReport, b: PassReport) -> PassReport:
    """Two passes of one leave as one report."""
    return PassReport(a.change, a.scanned + b.scanned, a.sent + b.sent, a.sent_bytes + b.sent_bytes,
                      a.present + b.present, a.dropped + b.dropped, b.finished, a.seconds + b.seconds)
