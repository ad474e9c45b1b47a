"""Prometheus metrics and /healthz on a small HTTP port (loopback by default).

Everything the engine counts is read at scrape time through one `Engine.stats()` call (a custom collector),
so the hot path pays nothing for metrics. Only RPC latencies and data-plane transfers are observed as they
happen (one histogram observe per RPC or transfer, ~1 us; transfers go into a kvstore.transfers.TransferMeter
that is read at scrape time too). Names follow Prometheus conventions (`*_total`, `*_bytes`, `*_seconds`); label
values are bounded: tiers and states are fixed sets, RPC methods are the service's methods, and namespaces
are capped at `MAX_NAMESPACE_LABELS` (the largest by bytes; the rest are summed under "_other").
Namespace and tenant label values are names, keyed hashes of names, or left out (metrics_namespace_labels,
kvstore/server/metric_labels.py): with tokens the default is hashes, since this port has no authentication.

Metric families (see deploy/grafana/kvstore.json for a dashboard on them):
  kvstore_lookup_keys_total                     keys asked for in lookups
  kvstore_hit_keys_total{tier}                  keys found, by the tier that held them (ram, disk, peer)
  kvstore_hit_bytes_total{tier}                 bytes handed to readers, by tier
  kvstore_misses_total{cause}                   prefix lookups that stopped short, by their first miss's cause
                                                (kvstore/engine/misses.py CAUSES; the causes add up to those lookups)
  kvstore_hints_total{action,outcome}           keys answered by agent hints (Hint RPC, connector), by action and
                                                outcome (kvstore/hint_vocab.py; every pair, zero included)
  kvstore_claim_keys_total{state}               keys schedulers claimed to compute (claimed), found being computed
                                                elsewhere (pending), found held, or could not record (refused)
  kvstore_restart_blocks_total{outcome}         blocks a predecessor held in RAM (hand-over, systemd's fd store):
                                                adopted, or dropped_<check> (kvstore/engine/counters.py)
  kvstore_namespace_lookup_keys_total{namespace} / kvstore_namespace_hit_keys_total{namespace}
  kvstore_namespace_blocks{namespace} / kvstore_namespace_bytes{namespace}
  Tokens (namespaces registered with tokens_per_block; the others have no token samples):
  kvstore_lookup_tokens_total                   tokens asked for in lookups (keys x tokens_per_block)
  kvstore_hit_tokens_total{tier}                tokens found, by the tier that held them (ram, disk)
  kvstore_namespace_lookup_tokens_total{namespace} / kvstore_namespace_hit_tokens_total{namespace,tier}
  kvstore_namespace_tokens_per_block{namespace}
  kvstore_committed_blocks_total / kvstore_committed_bytes_total
  kvstore_evictions_total / kvstore_evicted_bytes_total / kvstore_evicted_to_disk_total
  kvstore_promotions_total / kvstore_promotion_failures_total
  kvstore_disk_writes_total / kvstore_disk_write_failures_total / kvstore_demote_dropped_total
  kvstore_demote_queue_full_total (admission rejects for lack of queue room)
  kvstore_deleted_blocks_total / kvstore_store_full_total / kvstore_checksum_failures_total
  kvstore_lease_expirations_total / kvstore_reservation_expirations_total / kvstore_leases_active
  kvstore_reservations_active
  kvstore_arena_bytes{state}                    capacity, allocated, stored, reserved, leased, pinned, stranded
  kvstore_arena_fragmentation_ratio / kvstore_arena_locked / kvstore_blocks
  kvstore_disk_bytes{state}                     capacity, used
  kvstore_disk_blocks / kvstore_disk_degraded / kvstore_disk_compression_ratio
  kvstore_disk_native_aio                       1 while native AIO overlaps hashing with disk I/O; 0 after a refusal
  kvstore_disk_io_bytes_total{direction}        read, written
  kvstore_disk_evicted_blocks_total / kvstore_disk_reinserted_total / kvstore_disk_io_errors_total
  kvstore_disk_write_queue_blocks / kvstore_disk_promotion_queue_blocks / kvstore_disk_writeback_blocks
  kvstore_disk_writes_queued_total / kvstore_disk_writebacks_total / kvstore_evicted_unwritten_total
  kvstore_room_waits_total                      Reserves that waited for victims' write-backs (disk_write=evict)
  kvstore_disk_write_mode{mode}                 1 for the configured disk_write (commit, evict)
  kvstore_disk_budget_bytes_per_second / kvstore_disk_budget_probability   the write budget (if set) ...
  kvstore_disk_budget_window_bytes{state}       ... this window's admitted bytes and target
  kvstore_disk_budget_bytes_total{decision} / kvstore_disk_budget_blocks_total{decision}   admitted, refused
  kvstore_disk_quota_kept_blocks_total / kvstore_disk_quota_overcommitted_total   tenant disk quotas at reclamation
  kvstore_disk_cleaned_segments_total           reclamations that cleaned a younger segment RAM backs (cleaning.py)
  kvstore_tenant_bytes{tenant,tier} / kvstore_tenant_quota_bytes{tenant,tier}     usage against tenant quotas
  kvstore_event_subscribers                     KV-event streams open
  kvstore_event_drops_total                     KV events dropped for subscribers that fell behind
  kvstore_rpc_duration_seconds{method}          histogram of RPC handling time in the daemon
  kvstore_fast_connections                      open connections of the same-node fast path
  kvstore_fast_requests_total, _refused_total, _frame_errors_total, kvstore_arena_files_handed_total
  kvstore_key_index_tables / kvstore_key_index_keys / kvstore_key_index_unindexed_total   the shared key index
  kvstore_spare_slots / kvstore_spare_bytes     arena slots connections hold ahead of their puts (engine/spares.py)
  vLLM-format KV events (only with kv_events; kvstore/server/kv_events/publisher.py COUNTERS):
  kvstore_kv_events_{batches,events,subscriber_stalls,queue_dropped_events,replay_requests,replay_refused,
                     unknown_topic_subscriptions,origins_kept,origins_dropped}_total / kvstore_kv_events_blocks
  Peer tier (only when etcd_endpoints is set; counters listed in kvstore/peer/counters.py):
  kvstore_peer_members / kvstore_peer_etcd_connected / kvstore_peer_push_queue_blocks
  kvstore_peer_{fetch_calls,fetched_blocks,fetch_misses,served_blocks,pushed_blocks,pushes_dropped,
                received_pushes,errors,timeouts,frame_errors,checksum_failures,etcd_errors,rejoins}_total
  Data planes (plane/tier/direction: arena/ram, stream/ram, disk/disk, tcp|ucx|grpc/peer x in/out; see
  kvstore/transfers.py):
  kvstore_transfer_bytes_total{plane,tier,direction}
  kvstore_transfer_seconds{plane,tier,direction}                histogram, one observation per operation
  kvstore_transfer_gigabytes_per_second{plane,tier,direction}   histogram of each operation's GB/s (10^9 B/s)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.engine.engine import Engine
from kvstore.engine.counters import RESTART_DROP_REASONS
from kvstore.engine.misses import CAUSES, COUNTER_OF
from kvstore.engine.results import DiskWriting, EngineStats
from kvstore.errors import ConfigError
from kvstore.hint_vocab import HintAction, HintOutcome
from kvstore.policies.admission import WRITE_MODES
from kvstore.peer.cluster import PeerStatus
from kvstore.server.metric_collectors import (ControlCollector, KvEventsCollector, PeerCollector, StaticCollector,
                                              TransferCollector)
from kvstore.server.metric_labels import MetricLabels
from kvstore.tiers.disk import aio
from kvstore.server.tenant_usage import TenantUsage
from kvstore.transfers import TransferMeter

# the other collectors live in metric_collectors.py and are re-exported here
__all__ = ["MetricsServer", "EngineCollector", "TransferCollector", "PeerCollector", "ControlCollector",
           "MAX_NAMESPACE_LABELS", "RPC_BUCKETS"]

log = logging.getLogger(__name__)

MAX_NAMESPACE_LABELS = 50
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# engine counter -> (metric name without _total, help)
_COUNTERS = {
    "lookup_keys": ("kvstore_lookup_keys", "Keys asked for in lookups"),
    "committed_blocks": ("kvstore_committed_blocks", "Blocks committed (puts)"),
    "committed_bytes": ("kvstore_committed_bytes", "Bytes committed into the arena (puts)"),
    "evictions": ("kvstore_evictions", "Blocks evicted from the arena"),
    "evicted_bytes": ("kvstore_evicted_bytes", "Bytes evicted from the arena"),
    "evicted_to_disk": ("kvstore_evicted_to_disk", "Arena evictions whose block lives on in the disk tier"),
    "promotions": ("kvstore_promotions", "Disk-tier blocks read back into the arena"),
    "promotion_failures": ("kvstore_promotion_failures", "Promotions that failed (checksum, I/O, no room)"),
    "disk_writes": ("kvstore_disk_writes", "Blocks written to the disk tier"),
    "disk_write_failures": ("kvstore_disk_write_failures", "Blocks the disk tier failed to write"),
    "demote_dropped": ("kvstore_demote_dropped", "Queued disk writes dropped: evicted or deleted first"),
    "demote_queue_full": ("kvstore_demote_queue_full", "Blocks not admitted to disk: write queue full"),
    "disk_reinserted": ("kvstore_disk_reinserted", "Disk records kept at segment reclamation (read since written)"),
    "disk_writes_queued": ("kvstore_disk_writes_queued", "Blocks accepted into the disk write queue"),
    "disk_writebacks": ("kvstore_disk_writebacks", "RAM victims queued to be written before their slot is freed"),
    "evicted_unwritten": ("kvstore_evicted_unwritten",
                          "RAM victims without a disk copy left unwritten (admission, budget, Release, degraded)"),
    "room_waits": ("kvstore_room_waits", "Reserves that waited for victims' disk write-backs to free their slots"),
    "deleted_blocks": ("kvstore_deleted_blocks", "Blocks deleted by clients"),
    "store_full": ("kvstore_store_full", "Reserves refused: nothing evictable"),
    "checksum_failures": ("kvstore_checksum_failures", "Blocks that failed their checksum (counted as misses)"),
    "lease_expirations": ("kvstore_lease_expirations", "Read leases dropped by TTL (client died or was slow)"),
    "reservation_expirations": ("kvstore_reservation_expirations", "Reserved blocks dropped by TTL"),
    "slab_binds": ("kvstore_arena_slab_binds", "Empty arena slabs moved to another tenant's memory file (tokens on)"),
    "slab_bind_failures": ("kvstore_arena_slab_bind_failures", "Slab moves that failed (no memory): store full"),
    "hints_late_rejected": ("kvstore_hints_late_rejected",
                            "Hints deferred until their block's Commit, then refused there (pin budget, write queue)"),
}


class EngineCollector(Collector):
    """Turns one Engine.stats() snapshot into metric families at scrape time."""

    def __init__(self, engine: Engine, tenants: TenantUsage | None = None, labels: MetricLabels | None = None) -> None:
        self._engine = engine
        self._tenants = tenants
        self._labels = labels if labels is not None else MetricLabels("name")

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self._engine.stats()
        c = s.counters
        for key, (name, text) in _COUNTERS.items():
            yield CounterMetricFamily(name, text, value=c[key])
        hits = CounterMetricFamily("kvstore_hit_keys", "Keys found by lookups, by tier", labels=["tier"])
        hits.add_metric(["ram"], c["hit_keys_ram"])
        hits.add_metric(["disk"], c["hit_keys_disk"])
        hits.add_metric(["peer"], c["hit_keys_peer"])   # Lookups without lease only: bytes then come via RAM
        yield hits
        hit_bytes = CounterMetricFamily("kvstore_hit_bytes", "Bytes handed to readers, by tier", labels=["tier"])
        hit_bytes.add_metric(["ram"], c["hit_bytes_ram"])
        hit_bytes.add_metric(["disk"], c["hit_bytes_disk"])
        yield hit_bytes
        misses = CounterMetricFamily("kvstore_misses", "Prefix lookups that stopped short, by the cause of their "
                                     "first missing key", labels=["cause"])
        for cause in CAUSES:  # engine counters misses_<cause>: one labelled family, not a family each
            misses.add_metric([cause], c[COUNTER_OF[cause]])
        yield misses
        hints = CounterMetricFamily("kvstore_hints", "Keys answered by agent hints, by action and outcome",
                                    labels=["action", "outcome"])
        for action in HintAction:  # engine counters hint_<action>_<outcome>: one family, every pair
            for outcome in HintOutcome:
                hints.add_metric([action.value, outcome.value], c[f"hint_{action.value}_{outcome.value}"])
        yield hints
        restart = CounterMetricFamily("kvstore_restart_blocks", "Blocks a predecessor held in RAM (a hand-over, "
                                      "systemd's fd store): adopted, or dropped by the check they failed",
                                      labels=["outcome"])
        restart.add_metric(["adopted"], c["restart_adopted_blocks"])
        for reason in RESTART_DROP_REASONS:
            restart.add_metric([f"dropped_{reason}"], c[f"restart_dropped_{reason}"])
        yield restart
        claims = CounterMetricFamily("kvstore_claim_keys", "Keys schedulers' Claims were answered (claims.py): "
                                     "claimed (the caller computes them), pending (another scheduler is computing "
                                     "them: the caller waits for its save), held, refused (claimed but not recorded: "
                                     "the table was full)", labels=["state"])
        for state in ("claimed", "pending", "held", "refused"):
            claims.add_metric([state], c[f"claim_{state}_keys"])
        yield claims
        yield GaugeMetricFamily("kvstore_event_subscribers", "KV-event streams open",
                                value=self._engine.events.streams)
        yield CounterMetricFamily("kvstore_event_drops", "KV events dropped for subscribers that fell behind",
                                  value=self._engine.events.dropped_total)
        if self._labels.per_name:
            yield from _namespaces(s, self._labels)
        yield from _tokens(s, self._labels)
        yield from _arena(s)
        yield from _disk(s, self._engine)
        if self._tenants is not None and self._labels.per_name:
            yield from _tenants(s, self._tenants, self._labels)


def _namespaces(s: EngineStats, labels: MetricLabels) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    ranked = sorted(s.namespaces, key=lambda n: n.bytes, reverse=True)
    shown, rest = ranked[:MAX_NAMESPACE_LABELS], ranked[MAX_NAMESPACE_LABELS:]
    rows = [(labels.namespace(n.name), n.lookup_keys, n.hit_keys, n.blocks, n.bytes) for n in shown]
    if rest:
        rows.append(("_other", sum(n.lookup_keys for n in rest), sum(n.hit_keys for n in rest),
                     sum(n.blocks for n in rest), sum(n.bytes for n in rest)))
    fams: list[CounterMetricFamily | GaugeMetricFamily] = [
        CounterMetricFamily("kvstore_namespace_lookup_keys", "Keys looked up, by namespace", labels=["namespace"]),
        CounterMetricFamily("kvstore_namespace_hit_keys", "Keys found, by namespace", labels=["namespace"]),
        GaugeMetricFamily("kvstore_namespace_blocks", "Blocks in the arena, by namespace", labels=["namespace"]),
        GaugeMetricFamily("kvstore_namespace_bytes", "Bytes in the arena, by namespace", labels=["namespace"]),
    ]
    for name, *values in rows:
        for fam, v in zip(fams, values):
            fam.add_metric([name], v)
    yield from fams


def _tokens(s: EngineStats, labels: MetricLabels) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """Lookups in tokens: block counts x the namespace's tokens_per_block (fixed at registration).

    Daemon-wide totals cover every namespace with a known tokens_per_block; the per-namespace families keep
    the same cap and "_other" bucket as the block families (ranked by bytes), and are left out with labels
    "none"."""
    known = [n for n in s.namespaces if n.tokens_per_block]
    total = CounterMetricFamily("kvstore_lookup_tokens", "Tokens asked for in lookups (namespaces with "
                                "tokens_per_block)", value=sum(n.lookup_keys * n.tokens_per_block for n in known))
    hits = CounterMetricFamily("kvstore_hit_tokens", "Tokens found by lookups, by tier", labels=["tier"])
    hits.add_metric(["ram"], sum(n.hit_keys_ram * n.tokens_per_block for n in known))
    hits.add_metric(["disk"], sum(n.hit_keys_disk * n.tokens_per_block for n in known))
    hits.add_metric(["peer"], sum(n.hit_keys_peer * n.tokens_per_block for n in known))
    yield total
    yield hits
    if not labels.per_name:
        return
    ranked = sorted(known, key=lambda n: n.bytes, reverse=True)
    shown, rest = ranked[:MAX_NAMESPACE_LABELS], ranked[MAX_NAMESPACE_LABELS:]
    rows: list[tuple[str, int, int, int, int, int | None]] = [
            (labels.namespace(n.name), n.lookup_keys * n.tokens_per_block, n.hit_keys_ram * n.tokens_per_block,
             n.hit_keys_disk * n.tokens_per_block, n.hit_keys_peer * n.tokens_per_block, n.tokens_per_block)
            for n in shown]
    if rest:
        rows.append(("_other", sum(n.lookup_keys * n.tokens_per_block for n in rest),
                     sum(n.hit_keys_ram * n.tokens_per_block for n in rest),
                     sum(n.hit_keys_disk * n.tokens_per_block for n in rest),
                     sum(n.hit_keys_peer * n.tokens_per_block for n in rest), None))
    looked = CounterMetricFamily("kvstore_namespace_lookup_tokens", "Tokens looked up, by namespace",
                                 labels=["namespace"])
    found = CounterMetricFamily("kvstore_namespace_hit_tokens", "Tokens found, by namespace and tier",
                                labels=["namespace", "tier"])
    size = GaugeMetricFamily("kvstore_namespace_tokens_per_block", "Tokens in one block, by namespace",
                             labels=["namespace"])
    for name, lookup, ram, disk, peer, tpb in rows:
        looked.add_metric([name], lookup)
        found.add_metric([name, "ram"], ram)
        found.add_metric([name, "disk"], disk)
        found.add_metric([name, "peer"], peer)
        if tpb is not None:
            size.add_metric([name], tpb)
    yield looked
    yield found
    yield size


def _arena(s: EngineStats) -> Iterator[GaugeMetricFamily]:
    arena = GaugeMetricFamily("kvstore_arena_bytes", "Arena bytes by state", labels=["state"])
    for state, v in (("capacity", s.capacity_bytes), ("allocated", s.allocated_bytes), ("stored", s.stored_bytes),
                     ("reserved", s.reserved_bytes), ("leased", s.leased_bytes), ("pinned", s.pinned_bytes),
                     ("stranded", s.stranded_bytes)):
        arena.add_metric([state], v)
    yield arena
    yield GaugeMetricFamily("kvstore_arena_fragmentation_ratio", "Share of allocated slot bytes holding no payload",
                            value=s.fragmentation)
    yield GaugeMetricFamily("kvstore_blocks", "Blocks in the arena", value=s.blocks)
    yield GaugeMetricFamily("kvstore_leases_active", "Read leases held", value=s.leases_active)
    yield GaugeMetricFamily("kvstore_reservations_active", "Write reservations open", value=s.reservations_active)


def _disk(s: EngineStats, engine: Engine) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    d = s.disk
    if d is None:
        return
    space = GaugeMetricFamily("kvstore_disk_bytes", "Disk tier bytes by state", labels=["state"])
    space.add_metric(["capacity"], d.capacity_bytes)
    space.add_metric(["used"], d.used_bytes)
    yield space
    yield GaugeMetricFamily("kvstore_disk_blocks", "Blocks in the disk tier", value=d.blocks)
    yield GaugeMetricFamily("kvstore_disk_degraded", "1 while the disk tier is degraded", value=int(d.degraded))
    yield GaugeMetricFamily("kvstore_disk_native_aio", "1 while the disk tier overlaps hashing with its I/O (native "
                            "AIO); 0 after io_setup was refused (seccomp, fs.aio-max-nr): hashing then runs after "
                            "each transfer", value=int(aio.available()))
    yield GaugeMetricFamily("kvstore_disk_compression_ratio", "Raw / stored bytes written", value=d.compression_ratio)
    yield GaugeMetricFamily("kvstore_disk_write_queue_blocks", "Blocks waiting for the disk writer",
                            value=engine.write_queue_blocks)
    yield from _disk_writing(engine.disk_writing())
    io = CounterMetricFamily("kvstore_disk_io_bytes", "Disk tier bytes moved", labels=["direction"])
    io.add_metric(["written"], d.bytes_written)
    io.add_metric(["read"], d.bytes_read)
    yield io
    yield CounterMetricFamily("kvstore_disk_evicted_blocks", "Blocks dropped by disk segment reclamation",
                              value=d.evicted_blocks)
    yield CounterMetricFamily("kvstore_disk_io_errors", "Disk tier I/O errors", value=d.io_errors)
    yield CounterMetricFamily("kvstore_disk_quota_kept_blocks",
                              "Records kept at disk reclamation for a tenant's disk quota", value=d.quota_kept_blocks)
    yield CounterMetricFamily("kvstore_disk_quota_overcommitted",
                              "Disk reclamations that ignored quotas (protected bytes > capacity - 2 segments)",
                              value=d.quota_overcommitted)
    yield CounterMetricFamily("kvstore_disk_cleaned_segments",
                              "Disk reclamations of a younger segment RAM backs enough of (its unbacked records kept)",
                              value=d.cleaned_segments)


def _disk_writing(w: DiskWriting) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """When the disk tier is written (disk_write), what is in flight, and the write budget's state."""
    yield GaugeMetricFamily("kvstore_disk_promotion_queue_blocks", "Promotions started and not landed",
                            value=w.promotion_queue_blocks)
    yield GaugeMetricFamily("kvstore_disk_writeback_blocks", "RAM victims being written before their slot is freed",
                            value=w.writeback_blocks)
    mode = GaugeMetricFamily("kvstore_disk_write_mode", "1 for the configured disk_write", labels=["mode"])
    for name in WRITE_MODES:
        mode.add_metric([name], int(name == w.write_mode))
    yield mode
    b = w.budget
    if b is None:
        return
    yield GaugeMetricFamily("kvstore_disk_budget_bytes_per_second", "disk_write_budget", value=b.bytes_per_s)
    yield GaugeMetricFamily("kvstore_disk_budget_probability", "This window's admission probability",
                            value=b.probability)
    window = GaugeMetricFamily("kvstore_disk_budget_window_bytes", "Bytes admitted in this window, and its target",
                               labels=["state"])
    window.add_metric(["admitted"], b.window_admitted)
    window.add_metric(["target"], b.window_target)
    yield window
    nbytes = CounterMetricFamily("kvstore_disk_budget_bytes", "Bytes offered to the write budget, by decision",
                                 labels=["decision"])
    blocks = CounterMetricFamily("kvstore_disk_budget_blocks", "Blocks offered to the write budget, by decision",
                                 labels=["decision"])
    nbytes.add_metric(["admitted"], b.admitted_bytes)
    nbytes.add_metric(["refused"], b.refused_bytes)
    blocks.add_metric(["admitted"], b.admitted_blocks)
    blocks.add_metric(["refused"], b.refused_blocks)
    yield nbytes
    yield blocks


def _tenants(s: EngineStats, usage: TenantUsage, labels: MetricLabels) -> Iterator[GaugeMetricFamily]:
    rows = sorted(usage.rows(s.namespaces), key=lambda r: r.ram_bytes + r.disk_bytes, reverse=True)
    used = GaugeMetricFamily("kvstore_tenant_bytes", "Bytes held per tenant, by tier (what quotas compare)",
                             labels=["tenant", "tier"])
    quota = GaugeMetricFamily("kvstore_tenant_quota_bytes", "Guaranteed bytes per tenant, by tier (0: none)",
                              labels=["tenant", "tier"])
    for r in rows[:MAX_NAMESPACE_LABELS]:
        tenant = labels.tenant(r.tenant)
        used.add_metric([tenant, "ram"], r.ram_bytes)
        quota.add_metric([tenant, "ram"], r.ram_quota_bytes)
        if s.disk is not None:
            used.add_metric([tenant, "disk"], r.disk_bytes)
            quota.add_metric([tenant, "disk"], r.disk_quota_bytes)
    yield used
    yield quota


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        log.debug("metrics http: " + format, *args)


class MetricsServer:
    """/metrics (Prometheus text format) and /healthz on `host:port`, served from one background thread."""

    def __init__(self, listen: str, engine: Engine, arena_locked: bool, health: Callable[[], tuple[int, str]],
                 transfers: TransferMeter | None = None, peers: Callable[[], PeerStatus] | None = None,
                 tenants: TenantUsage | None = None, labels: MetricLabels | None = None,
                 control: Callable[[], dict[str, int]] | None = None,
                 kv_events: Callable[[], dict[str, int]] | None = None, bind: bool = True) -> None:
        """`control`: the same-node socket's counters (FastServer.status), read at each scrape; `kv_events`: the
        vLLM-format event publisher's (kv_events on). `bind` False: the port is still a predecessor's (a
        hand-over); `bind_when_free` takes it once it is gone."""
        host, _, port = listen.rpartition(":")
        self.labels = labels if labels is not None else MetricLabels("name")
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, tenants, self.labels))
        self.transfers = transfers if transfers is not None else TransferMeter()
        self.registry.register(TransferCollector(self.transfers, engine.disk_enabled, peers is not None))
        if peers is not None:
            self.registry.register(PeerCollector(peers))
        self.registry.register(ControlCollector(control if control is not None else dict))
        if kv_events is not None:
            self.registry.register(KvEventsCollector(kv_events))
        locked = GaugeMetricFamily("kvstore_arena_locked", "1 when the arena is mlock'ed", value=int(arena_locked))
        self.registry.register(StaticCollector([locked]))
        self.rpc_seconds = Histogram("kvstore_rpc_duration_seconds", "RPC handling time in the daemon",
                                     ["method"], buckets=RPC_BUCKETS, registry=self.registry)
        self._rpc_children: dict[str, Any] = {}
        metrics_app = make_wsgi_app(self.registry)

        def app(environ, start_response):
            if environ.get("PATH_INFO") == "/healthz":
                code, text = health()
                start_response(f"{code} {'OK' if code == 200 else 'Service Unavailable'}",
                               [("Content-Type", "text/plain")])
                return [text.encode() + b"\n"]
            return metrics_app(environ, start_response)

        self._listen = listen
        self._bound = False
        try:
            self._httpd: WSGIServer = WSGIServer((host, int(port)), _QuietHandler, bind_and_activate=False)
            self._httpd.set_app(app)
            if bind:
                self._bind()
        except OSError as exc:
            self._httpd.server_close()
            raise ConfigError(f"cannot serve metrics on {listen}: {exc.strerror}; choose another metrics_listen") from exc
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kvstore-metrics", daemon=True)

    def _bind(self) -> None:
        self._httpd.server_bind()
        self._httpd.server_activate()
        self._bound = True

    def bind_when_free(self, timeout_s: float) -> bool:
        """Bind once the port is free (a predecessor exiting releases it), retrying for up to timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._bind()
                return True
            except OSError as exc:
                if time.monotonic() > deadline:
                    log.warning("cannot serve metrics on %s: %s", self._listen, exc.strerror)
                    return False
                time.sleep(0.05)

    def observe(self, method: str, seconds: float) -> None:
        child = self._rpc_children.get(method)
        if child is None:  # labels() takes a lock and builds a key each time: once per method is enough
            child = self._rpc_children[method] = self.rpc_seconds.labels(method)
        child.observe(seconds)

    def start(self) -> None:
        if not self._bound:
            return
        self._thread.start()
        lab = self.labels
        log.info("metrics on %s: namespace and tenant labels = %s%s", self._listen, lab.mode,
                 (" (key from metrics_label_key_file)" if lab.keyed_from_file else " (a random key: labels change "
                  "at each restart)") if lab.mode == "hash" else "")

    def stop(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for serve_forever, which never ran if start() did not
            self._httpd.shutdown()
        self._httpd.server_close()
