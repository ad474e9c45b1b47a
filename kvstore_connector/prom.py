"""The connector's counters (kvstore_connector/stats.py) on vLLM's Prometheus /metrics, beside vLLM's own metrics.

vLLM asks the connector class for a `KVConnectorPromMetrics` (KVStoreConnector.build_prom_metrics) once per
stat logger, and hands it every scheduler step's connector stats: the dict of KVStoreStats, one interval's
deltas (get_kv_connector_stats takes and resets them), already summed over the workers. So each value is
added to a counter: the exposed numbers only ever grow, and a rate over them is the connector's throughput.

Names follow vLLM's connector metrics (``vllm:<connector>_<what>_total``), one per counter of COUNTER_NAMES,
except four families that share a counter under one label, its values the closed vocabularies of stats.py:

    vllm:kvstore_served_tokens_total{tier}      served_tokens_<tier>: vllm, ram, disk, peer
    vllm:kvstore_misses_total{cause}            miss_<cause>: kvstore_connector.misses.MISS_CAUSES
    vllm:kvstore_hints_total{outcome}           hint_<outcome>: kvstore_connector.hints.HINT_COUNTERS
    vllm:kvstore_session_notes_total{outcome}   session_noted (noted), session_note_failed (failed)
    vllm:kvstore_<name>_total                   every other name, e.g. vllm:kvstore_loaded_bytes_total

Every metric carries vLLM's per-engine labels (model_name, engine), and every series exists from the start at
0, so a dashboard sees the whole vocabulary before the first request. Labels stay bounded whatever a payload
holds (a newer worker's counter, another connector's key): an unknown name inside a family counts under the
label value ``other``; any other unknown name, and a value that is not a non-negative number, is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore_connector.stats import COUNTER_NAMES
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT

__all__ = ["FAMILIES", "OTHER", "KVStorePromMetrics", "Family", "metric_name"]

log = logging.getLogger(__name__)

PREFIX = "vllm:kvstore_"
OTHER = "other"  # the label value of a family's names this version does not know


@dataclass(frozen=True)
class Family:
    """Counters that share one Prometheus counter: ``prefix + value`` counts under ``label=value``
    (``names`` maps a counter whose name is not prefix + value)."""

    metric: str
    label: str
    prefix: str
    documentation: str
    names: tuple[tuple[str, str], ...] = ()  # (counter name, label value), beside the prefixed ones

    def values(self) -> dict[str, str]:
        """Counter name -> label value, for every name of COUNTER_NAMES in this family."""
        out = dict(self.names)
        for name in COUNTER_NAMES:
            if name.startswith(self.prefix) and name not in out:
                out[name] = name.removeprefix(self.prefix)
        return out


FAMILIES = (
    Family("served_tokens", "tier", "served_tokens_",
           "Looked-up prompt tokens by where they would come from: vLLM's own prefix cache, then the store's tiers."),
    Family("misses", "cause", "miss_",
           "Requests the store did not fully serve, by the cause of the first block it did not serve."),
    Family("hints", "outcome", "hint_",
           "Agent hints: one outcome per key and shard namespace, or how a hint failed before reaching the store."),
    Family("session_notes", "outcome", "session_note_",
           "Session notes sent to the daemon's session book, per shard namespace.",
           names=(("session_noted", "noted"), ("session_note_failed", "failed"))),
)


def metric_name(counter: str) -> str:
    """The exposed name of a counter outside the families, e.g. loaded_bytes -> vllm:kvstore_loaded_bytes_total."""
    return f"{PREFIX}{counter}_total"


class KVStorePromMetrics(KVConnectorPromMetrics):
    """Adds each observed interval to its counter child, per engine; see the module docstring for the names."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # counter name -> (engine index -> the child to add to); a family's unknown names -> its "other" child
        self._children: dict[str, dict[int, Any]] = {}
        self._other: dict[str, dict[int, Any]] = {}
        in_family: set[str] = set()
        for fam in FAMILIES:
            metric = self._counter_cls(name=f"{PREFIX}{fam.metric}_total", documentation=fam.documentation,
                                       labelnames=[*labelnames, fam.label])
            for counter, value in fam.values().items():
                self._children[counter] = self._per_engine(metric, value)
                in_family.add(counter)
            self._other[fam.prefix] = self._per_engine(metric, OTHER)
        for counter in COUNTER_NAMES:
            if counter not in in_family:
                metric = self._counter_cls(name=metric_name(counter), labelnames=list(labelnames),
                                           documentation=f"The kvstore connector's {counter} counter.")
                self._children[counter] = self._per_engine(metric)

    def _per_engine(self, metric: Any, *extra: str) -> dict[int, Any]:
        return {idx: metric.labels(*values, *extra) for idx, values in self.per_engine_labelvalues.items()}

    def _child(self, name: str) -> dict[int, Any] | None:
        known = self._children.get(name)
        if known is not None:
            return known
        for prefix, other in self._other.items():
            if name.startswith(prefix):
                return other
        return None

    def observe(self, transfer_stats_data: Mapping[str, Any], engine_idx: int = 0) -> None:
        if engine_idx not in self.per_engine_labelvalues:
            raise KeyError(f"engine {engine_idx} has no Prometheus labels (engines: "
                           f"{sorted(self.per_engine_labelvalues)})")
        for name, value in transfer_stats_data.items():
            child = self._child(name)
            if child is None or isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                log.debug("kvstore prometheus: dropped %r=%r (not a known counter with a non-negative number)",
                          name, value)
                continue
            if value:
                child[engine_idx].inc(value)
