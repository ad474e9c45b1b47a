"""This node's place in the cluster: its record in etcd under a lease, and the live member set, by watch.

Two threads:

    keepalive  every `refresh_s`: register (grant a lease with `ttl_s`, put this node's record under it) or
               renew the lease. A member is live while its record exists, i.e. while its daemon keeps its lease
               alive; a daemon killed with -9 drops out when its lease expires (at most `ttl_s`).
    watcher    reads every record under the prefix once (a range, which also says etcd's revision), then
               watches the prefix from the next revision (etcd_watch.py): every join and leave arrives as it
               happens, at every node, for one open stream per node. etcd's load is N keepalives per
               `refresh_s`, plus one event per change per node; no node re-reads the member set on a timer.
               A watch that ends (etcd restarted, compacted, `watch_idle_s` without a change) is opened again
               after a fresh read, so nothing is missed across it.

etcd down: calls fail (counted), this node keeps the last member set it read (peers that are alive keep
working; calls to dead ones time out and are misses) and retries every tick; the keepalive thread ends a
watch it cannot trust any more (its own call failed) so the watcher reads again once etcd answers. When etcd
answers again, the keepalive finds the lease gone (it expired meanwhile) and the node registers again (a
rejoin, counted). etcd refusing this node (untrusted certificate, wrong password, no permission: EtcdRefused)
is handled the same way, since the fix may land on etcd's side while the node runs; each distinct failure is
logged once per outage (an error for a refusal), so a wrong password is one clear line, not one a tick.
No consensus or gossip of our own: etcd is the only source of membership.

`on_change(members)` runs on the watcher thread (or in start()) after every change of the set, with the new
set; PeerCluster turns it into a change.MemberChange for placement, hand-off and reads. A member whose record
says `leaving` (mark_leaving: a node draining on SIGTERM) is still in the set, so it can still be read from,
but placement leaves it out: nothing new is pushed to it and its blocks' next owners are their owners now.
Settle markers (change.py says what settling means): a node that has handed off everything for the member set
named `digest` puts `<prefix>~settled/<digest>/<node_id>` under its lease (publish_settled) and deletes it, and
the marker of the set it changes to, at the next change it sees (unsettle: a set that comes back must be
settled again). A marker whose put or delete failed, or that a lost lease took along, is mended on the next
keepalive tick. Every node counts the markers of its current set's digest on its keepalive tick while it waits
(await_settled, until the hand-off window ends; etcd answers a count, no keys): N markers -> `settled_token`
is the waited-for token (the view's epoch), so a set seen again later is not settled by an earlier count.
Member records are the keys below `<prefix>~` (node ids never start with '~' or a byte above it: PeerConfig
checks), so the member watch never sees a marker: settling costs O(N) etcd calls per change, not an event to
every watcher for every node (O(N^2)).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from kvstore.peer.counters import PeerCounters
from kvstore.peer.etcd import EtcdClient, EtcdRefused, EtcdUnavailable
from kvstore.peer.etcd_watch import PrefixWatch, WatchCanceled, WatchEvent, WatchIdle

__all__ = ["Member", "Membership", "SETTLED"]

SETTLED = b"~settled/"  # settle markers: <prefix>~settled/<set digest>/<node id>, outside the member range

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Member:
    """One node's record in etcd (JSON): how to reach it and how big it is."""

    node_id: str
    control: str        # gRPC host:port
    data: str           # data-plane host:port
    plane: str          # tcp | ucx | grpc: the plane its data address speaks
    capacity_bytes: int
    leaving: bool = False  # draining (SIGTERM): still serving, no longer an owner of anything new

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @staticmethod
    def decode(raw: bytes) -> Member | None:
        try:
            d = json.loads(raw)
            return Member(str(d["node_id"]), str(d["control"]), str(d["data"]), str(d["plane"]),
                          int(d["capacity_bytes"]), bool(d.get("leaving", False)))
        except (ValueError, KeyError, TypeError):
            return None


class Membership:
    def __init__(self, etcd: EtcdClient, prefix: str, me: Member, *, ttl_s: float, refresh_s: float,
                 counters: PeerCounters, on_change: Callable[[dict[str, Member]], None] = lambda m: None,
                 watch_idle_s: float = 60.0) -> None:
        self._etcd = etcd
        self._prefix = prefix.encode()
        self.me = me
        self._ttl = max(1, round(ttl_s))  # etcd leases have whole seconds
        self._refresh = refresh_s
        self._idle = watch_idle_s
        self._counters = counters
        self._on_change = on_change
        self._lease = 0
        self._rewrite = False  # the lease is a predecessor's: write this node's record under it once
        self._members: dict[str, Member] = {me.node_id: me}
        self._lock = threading.Lock()          # _members, _watch
        self._change_lock = threading.Lock()   # one change applied and reported at a time, in order
        self._stop = threading.Event()
        self._watch: PrefixWatch | None = None
        self.connected = False
        self._logged: set[str] = set()  # failures logged during this outage (cleared when etcd answers)
        self._members_end = self._prefix + b"~"  # member records: [prefix, prefix~); settle markers above
        self._marker_lock = threading.Lock()   # publish, unsettle and the tick's mending, one at a time
        self._published = ""     # the digest of this node's settle marker ("" none)
        self._marker_lease = 0   # the lease it was put under (a re-granted lease needs it put again)
        self._stale: set[str] = set()  # digests of markers whose delete failed (retried each tick)
        self._settle_wait: tuple[str, int, int, float] | None = None  # digest, members, token, until
        self._settled_token = -1
        self._keeper = threading.Thread(target=self._keep_loop, name="kvstore-membership", daemon=True)
        self._watcher = threading.Thread(target=self._watch_loop, name="kvstore-member-watch", daemon=True)

    # -- reads (any thread) ------------------------------------------------------------------------------
    def members(self) -> dict[str, Member]:
        """The live member set, this node included (a copy)."""
        with self._lock:
            return dict(self._members)

    # -- life cycle --------------------------------------------------------------------------------------
    @property
    def lease(self) -> int:
        """This node's etcd lease (0: none yet); a hand-over passes it to the successor (keep_lease)."""
        return self._lease

    def keep_lease(self, lease: int) -> None:
        """Before start: carry on a predecessor's lease (a hand-over restart of this node: same node id). Its
        record is written again under it, equal to before, so peers see no member change and hand nothing off;
        a lease that expired meanwhile is replaced as after an etcd outage (a rejoin)."""
        self._lease = lease
        self._rewrite = True

    def start(self) -> None:
        """Join and read the member set before serving peers when etcd is up (a down etcd only logs and
        retries), then keep the lease alive and watch."""
        try:
            self._keep_registered()
            self._read_all()
        except EtcdUnavailable as exc:
            self._failed(exc)
        self._keeper.start()
        self._watcher.start()

    def mark_leaving(self) -> bool:
        """Rewrite this node's record as leaving (same lease): every watcher takes it out of placement at once
        while it still serves reads. False when etcd did not take it (the leave then goes on regardless)."""
        return self._rewrite_record(dataclasses.replace(self.me, leaving=True),
                                    "peers learn it from the lease revoke")

    def _rewrite_record(self, me: Member, otherwise: str) -> bool:
        self.me = me
        with self._lock:
            self._members[me.node_id] = me
        if not self._lease:
            return False
        try:
            self._etcd.put(self._prefix + me.node_id.encode(), me.encode(), self._lease)
        except EtcdUnavailable as exc:
            log.warning("could not update this node's record in etcd (%s): %s", exc, otherwise)
            return False
        return True

    # -- settle markers -----------------------------------------------------------------------------------
    def _marker(self, digest: str) -> bytes:
        return self._prefix + SETTLED + digest.encode() + b"/" + self.me.node_id.encode()

    def publish_settled(self, digest: str) -> bool:
        """Say (a marker under this node's lease) that it has handed off everything for the member set named
        `digest` (change.set_digest). False when etcd did not take it now (the keepalive tick puts it)."""
        with self._marker_lock:
            old, self._published, self._marker_lease = self._published, digest, 0
            if old and old != digest:
                self._stale.add(old)
            return self._mend()

    def unsettle(self, also: str = "") -> None:
        """A change was seen: this node's marker goes, and so does any of its markers for `also` (the set it
        changed to: a marker of an earlier time that set was current, or a publish that raced the change), so no
        set is counted settled with it while its hand-off runs."""
        with self._marker_lock:
            self._stale.update(d for d in (self._published, also) if d)
            self._published, self._marker_lease = "", 0
            self._mend()

    def _mend(self) -> bool:
        """Under _marker_lock: delete the stale markers, put the published one under the current lease. True when
        etcd has exactly what it should."""
        ok = True
        for digest in sorted(self._stale):
            try:
                self._etcd.delete(self._marker(digest))
                self._stale.discard(digest)
            except EtcdUnavailable as exc:  # kept: retried on the next tick (it leaves with the lease at the latest)
                log.info("could not delete the settle marker of set %s (retried): %s", digest, exc)
                ok = False
        if self._published and self._marker_lease != self._lease:
            if not self._lease:
                return False
            try:
                self._etcd.put(self._marker(self._published), b"", self._lease)
                self._marker_lease = self._lease
            except EtcdUnavailable as exc:
                log.warning("could not publish this node's settle marker (%s): retried on the next tick; peers "
                            "ask previous owners meanwhile", exc)
                return False
        return ok

    def await_settled(self, digest: str, members: int, token: int, until: float) -> None:
        """Count `digest`'s markers on every keepalive tick until there are `members` (then `settled_token` is
        `token`) or the clock passes `until` (the hand-off window's end: nothing to settle after it). A newer
        call replaces the wait."""
        with self._lock:
            self._settle_wait = (digest, members, token, until)

    @property
    def settled_token(self) -> int:
        """The token of the last wait whose set every member was counted settled for (-1 before any)."""
        return self._settled_token

    def _settle_tick(self) -> None:
        """The keepalive tick's settle work: mend this node's markers, count the awaited set's. A failure here is
        logged and retried; it does not make etcd count as down (the keepalive answered)."""
        try:
            with self._marker_lock:
                self._mend()
            with self._lock:
                wait = self._settle_wait
            if wait is None:
                return
            digest, members, token, until = wait
            if time.monotonic() > until:
                with self._lock:
                    if self._settle_wait == wait:
                        self._settle_wait = None
                return
            n = self._etcd.count_prefix(self._prefix + SETTLED + digest.encode() + b"/")
        except EtcdUnavailable as exc:
            self._counters.add("etcd_errors")
            log.info("settle markers: %s (retried on the next tick)", exc)
            return
        with self._lock:
            if n >= members and self._settle_wait == wait:
                self._settled_token, self._settle_wait = token, None

    def stop(self, revoke: bool = True) -> None:
        """Leave at once (revoke the lease) so peers stop routing here without waiting for the TTL. `revoke`
        False (a hand-over): stop the threads and leave the lease and record to the successor."""
        self._stop.set()
        self._end_watch()
        for t in (self._keeper, self._watcher):
            if t.is_alive():
                t.join(timeout=5)
        if self._lease and revoke:
            try:
                self._etcd.revoke(self._lease)
            except EtcdUnavailable:
                pass  # the lease expires by itself

    # -- keepalive thread --------------------------------------------------------------------------------
    def _keep_loop(self) -> None:
        while not self._stop.wait(self._refresh):
            try:
                self._keep_registered()
            except EtcdUnavailable as exc:
                self._failed(exc)
                self._end_watch()  # the watcher reads again (and says what changed) once etcd answers
                continue
            except Exception:  # membership must outlive a bug in one tick; the log says what happened
                log.exception("membership keepalive failed")
                continue
            self._answered()
            self._settle_tick()

    def _keep_registered(self) -> None:
        if self._lease and self._etcd.keepalive(self._lease) > 0:
            if self._rewrite:  # a predecessor's lease: this process's record under it (same key)
                self._etcd.put(self._prefix + self.me.node_id.encode(), self.me.encode(), self._lease)
                self._rewrite = False
            return
        if self._lease:
            log.warning("etcd lease %x expired (etcd was unreachable longer than %ss): registering again",
                        self._lease, self._ttl)
        self._lease = self._etcd.grant(self._ttl)
        self._rewrite = False
        self._etcd.put(self._prefix + self.me.node_id.encode(), self.me.encode(), self._lease)
        self._counters.add("rejoins")

    # -- watcher thread ----------------------------------------------------------------------------------
    def _watch_loop(self) -> None:
        while not self._stop.is_set():
            opened = False
            try:
                revision = self._read_all()
                watch = PrefixWatch.open(self._etcd, self._prefix, revision + 1, self._idle, self._members_end)
                with self._lock:
                    if self._stop.is_set():
                        watch.close()
                        return
                    self._watch = watch
                opened = True
                for batch in watch.batches():
                    self._apply(batch)
            except WatchIdle:
                continue  # a quiet prefix: read and watch again (neither an error nor a restart)
            except WatchCanceled as exc:
                log.info("etcd ended the member watch (%s): reading the member set again", exc)
            except EtcdUnavailable as exc:
                if not self._stop.is_set():
                    self._failed(exc)
                    self._stop.wait(self._refresh)
            except Exception:
                log.exception("member watch failed")
                self._stop.wait(self._refresh)
            finally:
                self._end_watch()
            if opened and not self._stop.is_set():
                self._counters.add("watch_restarts")  # the watch ended under us: read and watch again

    def _read_all(self) -> int:
        """Read every member record; the member set becomes exactly those. Returns etcd's revision."""
        revision, records = self._etcd.range_prefix_at(self._prefix, self._members_end)
        found = {self.me.node_id: self.me}
        for _, raw in records:
            m = Member.decode(raw)
            if m is None:
                log.warning("ignoring an unreadable member record under %s", self._prefix.decode())
            elif m.node_id != self.me.node_id:
                found[m.node_id] = m
        self._answered()
        self._set(found)
        return revision

    def _apply(self, batch: list[WatchEvent]) -> None:
        """One revision's changes under the prefix, applied to the member set."""
        found = self.members()
        for ev in batch:
            node_id = ev.key[len(self._prefix):].decode(errors="replace")
            if node_id == self.me.node_id:
                continue  # this node is a member while it runs; a lost lease is the keepalive's to mend
            if ev.kind == "delete":
                found.pop(node_id, None)
                continue
            m = Member.decode(ev.value)
            if m is None or m.node_id != node_id:
                log.warning("ignoring an unreadable member record %r under %s", node_id, self._prefix.decode())
                continue
            found[node_id] = m
        self._set(found)

    def _set(self, found: dict[str, Member]) -> None:
        with self._change_lock:
            with self._lock:
                changed = found != self._members
                self._members = found
            if changed:
                self._counters.add("member_changes")
                log.info("member set: %s", ", ".join(sorted(found)))
                self._on_change(dict(found))

    def _end_watch(self) -> None:
        with self._lock:
            watch, self._watch = self._watch, None
        if watch is not None:
            watch.close()

    # -- etcd state --------------------------------------------------------------------------------------
    def _failed(self, exc: EtcdUnavailable) -> None:
        self._counters.add("etcd_errors")
        if str(exc) not in self._logged and len(self._logged) < 64:
            self._logged.add(str(exc))
            if isinstance(exc, EtcdRefused):
                log.error("etcd refused this node, serving with the last member set (%d members): %s",
                          len(self._members), exc)
            else:
                log.warning("etcd unreachable, serving with the last member set (%d members): %s",
                            len(self._members), exc)
        self.connected = False

    def _answered(self) -> None:
        if not self.connected:
            log.info("etcd reachable: registered as %s", self.me.node_id)
        self.connected = True
        self._logged.clear()

