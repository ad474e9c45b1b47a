"""What the deploy tests share: the names of the connector's metrics on vLLM's /metrics (kvstore_connector/prom.py, which
imports vLLM and so cannot be imported in the main environment)."""

from __future__ import annotations

from kvstore_connector.stats import COUNTER_NAMES

__all__ = ["connector_metric_names"]

# the connector's families that put several counters under one label (kvstore_connector/prom.py FAMILIES)
CONNECTOR_FAMILIES = ("served_tokens", "misses", "hints", "session_notes")


def connector_metric_names() -> set[str]:
    return {f"vllm:kvstore_{n}_total" for n in (*COUNTER_NAMES, *CONNECTOR_FAMILIES)}
