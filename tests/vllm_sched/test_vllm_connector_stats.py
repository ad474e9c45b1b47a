"""KVStoreStats, what vLLM's stats logging reduces an interval of connector counters to."""

from __future__ import annotations

from kvstore_connector.vllm_connector import KVStoreStats


def test_reduce_adds_the_hit_rate_and_the_requests_that_missed() -> None:
    data = {"lookup_tokens": 100, "hit_tokens": 40, "miss_never_stored": 2, "miss_evicted": 1, "saved_blocks": 5}
    assert KVStoreStats(data=dict(data)).reduce() == {**data, "hit_rate": 0.4, "miss_causes": 3}
    assert KVStoreStats(data={"saved_blocks": 1}).reduce() == {"saved_blocks": 1}   # nothing looked up or missed
    agg = KVStoreStats(data={"miss_evicted": 1}).aggregate(KVStoreStats(data={"miss_evicted": 2, "hit_tokens": 8}))
    assert agg.reduce() == {"miss_evicted": 3, "hit_tokens": 8, "miss_causes": 3}
