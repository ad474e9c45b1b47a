"""The connector's counters on vLLM's Prometheus metrics (kvstore_connector/prom.py): the mapping of a stats payload to
counters, on a registry of the test's own (vLLM builds the metrics with the classes it passes in
metric_types), and then the whole path as vLLM runs it: its real Scheduler's SchedulerStats recorded by its
own PrometheusStatLogger, which builds the metrics through KVStoreConnector.build_prom_metrics."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from kvstore_connector.hints import HINT_COUNTERS
from kvstore_connector.misses import MISS_CAUSES
from kvstore_connector.prom import KVStorePromMetrics
from kvstore_connector.stats import COUNTER_NAMES
from kvstore_connector.vllm_connector import KVStoreConnector
from vllm.config import DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.v1.metrics.loggers import PrometheusStatLogger

from .harness import Harness
from .stored import PROMPT

LABELS = ["model_name", "engine"]
HINT_OUTCOMES = {n.removeprefix("hint_") for n in HINT_COUNTERS if n.startswith("hint_")}


def build(model_dir: str, engines: tuple[int, ...] = (0,)) -> tuple[KVStorePromMetrics, CollectorRegistry]:
    """The connector's metrics as vLLM builds them, each metric class bound to a fresh registry."""
    registry = CollectorRegistry()

    def bound(cls: Any) -> Any:
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **kw: cls.__init__(
            self, *a, registry=registry, **kw)})

    config = VllmConfig(model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32",
                                                 max_model_len=4096),
                        kv_transfer_config=KVTransferConfig(kv_connector="KVStoreConnector",
                                                            kv_connector_module_path="kvstore_connector.vllm_connector",
                                                            kv_role="kv_both"),
                        device_config=DeviceConfig("cpu"))
    metrics = KVStoreConnector.build_prom_metrics(
        config, {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}, list(LABELS),
        {i: ["tiny", str(i)] for i in engines})
    assert isinstance(metrics, KVStorePromMetrics)
    return metrics, registry


def value(registry: CollectorRegistry, name: str, engine: int = 0, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"model_name": "tiny", "engine": str(engine), **labels})


def series(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every kvstore counter sample: (name, labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in registry.collect() for s in m.samples
            if s.name.startswith("vllm:kvstore_") and s.name.endswith("_total")}


def test_each_interval_adds_to_the_counters_of_its_family_and_label(model_dir) -> None:
    metrics, reg = build(model_dir)
    interval = {"served_tokens_vllm": 16, "served_tokens_ram": 32, "served_tokens_disk": 16, "miss_evicted": 2,
                "miss_store_down": 1, "hint_accepted": 3, "hint_malformed": 1, "session_noted": 2,
                "session_note_failed": 1, "loaded_bytes": 4096, "load_seconds": 0.25, "hit_tokens": 48}
    metrics.observe(interval, 0)
    metrics.observe(interval, 0)                               # a second interval adds: counters only grow
    assert value(reg, "vllm:kvstore_served_tokens_total", tier="vllm") == 32
    assert value(reg, "vllm:kvstore_served_tokens_total", tier="ram") == 64
    assert value(reg, "vllm:kvstore_served_tokens_total", tier="disk") == 32
    assert value(reg, "vllm:kvstore_served_tokens_total", tier="peer") == 0     # known series exist at 0
    assert value(reg, "vllm:kvstore_misses_total", cause="evicted") == 4
    assert value(reg, "vllm:kvstore_misses_total", cause="store_down") == 2
    assert value(reg, "vllm:kvstore_misses_total", cause="never_stored") == 0
    assert value(reg, "vllm:kvstore_hints_total", outcome="accepted") == 6
    assert value(reg, "vllm:kvstore_hints_total", outcome="malformed") == 2
    assert value(reg, "vllm:kvstore_session_notes_total", outcome="noted") == 4
    assert value(reg, "vllm:kvstore_session_notes_total", outcome="failed") == 2
    assert value(reg, "vllm:kvstore_loaded_bytes_total") == 8192
    assert value(reg, "vllm:kvstore_load_seconds_total") == 0.5
    assert value(reg, "vllm:kvstore_hit_tokens_total") == 96
    assert sum(series(reg).values()) == 2 * sum(interval.values())  # nothing counted twice or elsewhere


def test_every_counter_name_has_exactly_one_series_and_labels_stay_in_their_vocabularies(model_dir) -> None:
    metrics, reg = build(model_dir)
    metrics.observe(dict.fromkeys(COUNTER_NAMES, 1), 0)
    samples = series(reg)
    assert sum(samples.values()) == len(COUNTER_NAMES)
    assert all(v in (0, 1) for v in samples.values())
    by_label: dict[str, set[str]] = {}
    for name, labels in samples:
        for k, v in labels:
            if k not in LABELS:
                by_label.setdefault(f"{name}{{{k}}}", set()).add(v)
    assert by_label == {
        "vllm:kvstore_served_tokens_total{tier}": {"vllm", "ram", "disk", "peer", "other"},
        "vllm:kvstore_misses_total{cause}": {*MISS_CAUSES, "other"},
        "vllm:kvstore_hints_total{outcome}": {*HINT_OUTCOMES, "other"},
        "vllm:kvstore_session_notes_total{outcome}": {"noted", "failed", "other"},
    }
    assert all(samples[k] == 0 for k in samples if ("tier", "other") in k[1] or ("cause", "other") in k[1]
               or ("outcome", "other") in k[1])


def test_unknown_names_count_as_other_in_their_family_or_are_dropped(model_dir) -> None:
    metrics, reg = build(model_dir)
    before = set(series(reg))
    metrics.observe({"miss_martians": 1, "hint_sideways": 2, "served_tokens_nvme": 5, "session_note_lost": 3,
                     "mystery_counter": 7, "hit_tokens": -3, "lookup_tokens": "12", "saved_blocks": True,
                     "loaded_blocks": float("nan"), "save_keys": 4}, 0)
    assert set(series(reg)) == before                          # no new series: labels stay bounded
    assert value(reg, "vllm:kvstore_misses_total", cause="other") == 1
    assert value(reg, "vllm:kvstore_hints_total", outcome="other") == 2
    assert value(reg, "vllm:kvstore_served_tokens_total", tier="other") == 5
    assert value(reg, "vllm:kvstore_session_notes_total", outcome="other") == 3
    assert sum(series(reg).values()) == 1 + 2 + 5 + 3 + 4      # the bad values and the stray name: dropped
    assert value(reg, "vllm:kvstore_save_keys_total") == 4


def test_each_engine_counts_under_its_own_label(model_dir) -> None:
    metrics, reg = build(model_dir, engines=(0, 1))
    metrics.observe({"served_tokens_ram": 32, "miss_evicted": 1}, 1)
    metrics.observe({"served_tokens_ram": 16}, 0)
    metrics.observe({"served_tokens_ram": 16}, 1)
    assert value(reg, "vllm:kvstore_served_tokens_total", engine=0, tier="ram") == 16
    assert value(reg, "vllm:kvstore_served_tokens_total", engine=1, tier="ram") == 48
    assert value(reg, "vllm:kvstore_misses_total", engine=0, cause="evicted") == 0
    assert value(reg, "vllm:kvstore_misses_total", engine=1, cause="evicted") == 1
    with pytest.raises(KeyError, match="engine 2 has no Prometheus labels"):
        metrics.observe({"served_tokens_ram": 1}, 2)


def test_vllm_prometheus_logger_records_the_connector_counters_of_a_real_scheduler_run(daemon, model_dir) -> None:
    """A prompt stored, vLLM's prefix cache reset, the prompt again: loaded from the store's RAM. Every step's
    SchedulerStats (the scheduler's and the workers' counters, aggregated by vLLM) goes to vLLM's own
    PrometheusStatLogger, which must end with exactly the connector's totals."""
    h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1})
    try:
        prom = PrometheusStatLogger(h.vllm_config, engine_indexes=[0])
        h.add("r1", PROMPT)
        h.run()
        assert h.scheduler.reset_prefix_cache()
        h.add("r2", list(PROMPT))
        h.run()
        for stats in h.scheduler_stats:
            prom.record(scheduler_stats=stats, iteration_stats=None, engine_idx=0)
        totals = {k: h.sched_side.counters.totals.get(k, 0) + h.worker.counters.totals.get(k, 0)
                  for k in COUNTER_NAMES}
    finally:
        h.close()
    labels = {"model_name": h.vllm_config.model_config.served_model_name, "engine": "0"}

    def got(name: str, **extra: str) -> float | None:
        return REGISTRY.get_sample_value(name, {**labels, **extra})

    # r1: its 96 full-block tokens looked up, none stored (never stored), 6 blocks saved; r2: 96 from the store's RAM
    assert got("vllm:kvstore_lookup_tokens_total") == 192                  # full blocks only: 96 each
    assert got("vllm:kvstore_hit_tokens_total") == 96
    assert got("vllm:kvstore_served_tokens_total", tier="ram") == 96
    assert got("vllm:kvstore_served_tokens_total", tier="disk") == 0
    assert got("vllm:kvstore_misses_total", cause="never_stored") == 1
    assert got("vllm:kvstore_loaded_blocks_total") == 6
    assert got("vllm:kvstore_saved_blocks_total") == 6
    for family, label, prefix in (("served_tokens", "tier", "served_tokens_"), ("misses", "cause", "miss_")):
        for name in (n for n in COUNTER_NAMES if n.startswith(prefix)):
            assert got(f"vllm:kvstore_{family}_total", **{label: name.removeprefix(prefix)}) == totals[name], name
    for name in ("lookup_tokens", "hit_tokens", "load_requests", "save_keys", "loaded_blocks", "loaded_bytes",
                 "saved_blocks", "saved_bytes", "load_failed_blocks"):
        assert got(f"vllm:kvstore_{name}_total") == totals[name], name
