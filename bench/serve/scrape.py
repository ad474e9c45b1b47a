"""Counters from Prometheus text (vLLM's /metrics, kvstore's metrics endpoint), summed over label sets and
differenced around a run, so a configuration's figures count only its own work."""

from __future__ import annotations

import re
import urllib.request

__all__ = ["scrape", "delta", "VLLM_COUNTERS"]

_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)')

# vLLM v1 counters: tokens (prompts, local prefix-cache hits, the KV connector's hits, generated tokens) and the
# request histograms' sums and counts (seconds a request waited to be scheduled, seconds in prefill): where a
# configuration's TTFT goes; preemptions (a running request's blocks taken back for lack of KV memory)
VLLM_COUNTERS = ("vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total",
                 "vllm:external_prefix_cache_hits_total", "vllm:generation_tokens_total",
                 "vllm:request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_count",
                 "vllm:request_prefill_time_seconds_sum", "vllm:request_prefill_time_seconds_count",
                 "vllm:num_preemptions_total", *(f"vllm:kvstore_{n}_total" for n in (
                     # the connector's claims (kvstore_connector/claims.py): keys claimed on a miss, keys found
                     # being computed by another server, loads that waited, served whole, keys that did not come
                     "claimed_keys", "claim_pending_keys", "claim_waits", "claim_waits_served",
                     "claim_wait_missed_keys", "claim_wait_seconds")))


def scrape(url: str, names: tuple[str, ...] | None = None, by_label: str | None = None,
           timeout_s: float = 5.0) -> dict[str, float]:
    """{name: value} summed over label sets, or {name[label=value]: value} per value of `by_label`."""
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m or (names is not None and m.group(1) not in names):
            continue
        key = m.group(1)
        if by_label and m.group(2):
            lab = re.search(by_label + r'="([^"]*)"', m.group(2))
            if lab:
                key = f"{key}[{by_label}={lab.group(1)}]"
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(before) | set(after))}
