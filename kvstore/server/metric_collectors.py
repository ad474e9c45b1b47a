"""The daemon's small metric collectors, read at scrape time: data-plane transfers, the peer tier, the same-node
socket, and fixed gauges. kvstore/server/metrics.py lists every family and serves them; the engine's own
families are its EngineCollector.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvstore.peer.cluster import PeerStatus
from kvstore.peer.counters import COUNTER_HELP
from kvstore.server.kv_events.counters import COUNTERS
from kvstore.transfers import GBPS_BUCKETS, SECONDS_BUCKETS, TransferMeter

__all__ = ["TransferCollector", "PeerCollector", "ControlCollector", "KvEventsCollector", "StaticCollector"]


class TransferCollector(Collector):
    """Data-plane bytes and per-operation latency / GB/s histograms, read from a TransferMeter at scrape time."""

    def __init__(self, meter: TransferMeter, with_disk: bool, with_peers: bool = False) -> None:
        self._meter = meter
        self._with_disk = with_disk  # no disk tier: no disk series (as the other kvstore_disk_* families)
        self._with_peers = with_peers  # no peer tier: no peer series

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        labels = ["plane", "tier", "direction"]
        moved = CounterMetricFamily("kvstore_transfer_bytes", "Bytes moved, by data plane, tier and direction",
                                    labels=labels)
        seconds = HistogramMetricFamily("kvstore_transfer_seconds", "Duration of each data-plane operation",
                                        labels=labels)
        gbps = HistogramMetricFamily("kvstore_transfer_gigabytes_per_second",
                                     "Throughput of each data-plane operation (10^9 bytes per second)", labels=labels)
        for t in self._meter.snapshot():
            if (t.plane == "disk" and not self._with_disk) or (t.tier == "peer" and not self._with_peers):
                continue
            key = [t.plane, t.tier, t.direction]
            moved.add_metric(key, t.bytes)
            seconds.add_metric(key, _buckets(SECONDS_BUCKETS, t.seconds_buckets), t.seconds_sum)
            gbps.add_metric(key, _buckets(GBPS_BUCKETS, t.gbps_buckets), t.gbps_sum)
        yield moved
        yield seconds
        yield gbps


class PeerCollector(Collector):
    """The peer tier: member count, etcd state, push queue, and its counters (kvstore/peer/counters.py)."""

    def __init__(self, status: Callable[[], PeerStatus]) -> None:
        self._status = status

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        st = self._status()
        yield GaugeMetricFamily("kvstore_peer_members", "Live members of the cluster, this node included",
                                value=len(st.members))
        yield GaugeMetricFamily("kvstore_peer_etcd_connected", "1 while etcd answers", value=int(st.etcd_connected))
        yield GaugeMetricFamily("kvstore_peer_push_queue_blocks", "Blocks waiting to be pushed to owners",
                                value=st.pending_pushes)
        yield GaugeMetricFamily("kvstore_peer_handoffs_pending", "Hand-off passes queued or running after membership "
                                "changes (0: every change seen so far is handed off)", value=st.pending_handoffs)
        yield GaugeMetricFamily("kvstore_peer_settled", "1 when reads ask each block's owners only: every member has "
                                "handed off for the current member set (or the hand-off window ended)",
                                value=int(st.settled))
        for name, text in COUNTER_HELP.items():
            yield CounterMetricFamily(f"kvstore_peer_{name}", text, value=st.counters.get(name, 0))


def _buckets(bounds: tuple[float, ...], cumulative: tuple[int, ...]) -> list[tuple[str, int]]:
    return [(floatToGoString(b), c) for b, c in zip(bounds, cumulative)] + [("+Inf", cumulative[-1])]


class ControlCollector(Collector):
    """The same-node socket: fast-path connections and requests, arena files handed out (fast_server.py), and
    the shared key index's fill when it runs."""

    def __init__(self, status: Callable[[], dict[str, int]]) -> None:
        self._status = status

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        st = self._status()
        yield GaugeMetricFamily("kvstore_fast_connections", "Open fast-path connections on the same-node socket",
                                value=st.get("fast_connections", 0))
        for key, text in (("fast_requests", "Hot operations answered over the same-node fast path"),
                          ("fast_refused", "Same-node connections refused (bad hello or token, too many)"),
                          ("fast_frame_errors", "Same-node connections closed for a malformed frame"),
                          ("arena_files_handed", "Arena memory files handed to local clients")):
            yield CounterMetricFamily(f"kvstore_{key}", text, value=st.get(key, 0))
        if "spare_slots" in st:  # slots the connections hold ahead of their puts (engine/spares.py)
            yield GaugeMetricFamily("kvstore_spare_slots", "Arena slots fast-path connections hold ahead of their "
                                    "puts (never evicted)", value=st["spare_slots"])
            yield GaugeMetricFamily("kvstore_spare_bytes", "Arena bytes of spare slots, quarantined ones included "
                                    "(a closed connection's, freed after quarantine_s)", value=st["spare_bytes"])
        if "key_index_keys" in st:  # the shared key index (engine/key_mirror.py), when the daemon runs one
            yield GaugeMetricFamily("kvstore_key_index_tables", "Shared key index tables (one per tenant seen)",
                                    value=st["key_index_tables"])
            yield GaugeMetricFamily("kvstore_key_index_keys", "RAM blocks in the shared key indexes, all tenants",
                                    value=st["key_index_keys"])
            yield CounterMetricFamily("kvstore_key_index_unindexed", "Blocks committed while their tenant's key index "
                                      "was 3/4 full (probed the usual way; raise key_index_entries)",
                                      value=st["key_index_unindexed"])


class KvEventsCollector(Collector):
    """The vLLM-format event publisher (kv_events on): batches, drops, replays, identities; the blocks it names."""

    def __init__(self, status: Callable[[], dict[str, int]]) -> None:
        self._status = status

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        st = self._status()
        for key, text in COUNTERS.items():
            yield CounterMetricFamily(f"kvstore_kv_events_{key}", text, value=st.get(key, 0))
        yield GaugeMetricFamily("kvstore_kv_events_blocks", "(namespace, key) pairs the vLLM-format events name "
                                "as held in some tier", value=st.get("blocks", 0))


class StaticCollector(Collector):
    def __init__(self, families: list[GaugeMetricFamily]) -> None:
        self._families = families

    def collect(self) -> Iterator[GaugeMetricFamily]:
        return iter(self._families)
