"""The publisher's counters, with the help text /metrics gives them (kvstore_kv_events_<name>_total)."""

from __future__ import annotations

__all__ = ["COUNTERS"]

COUNTERS = {
    "batches": "vLLM-format event batches published",
    "events": "vLLM-format events published (BlockStored, BlockRemoved, AllBlocksCleared)",
    "subscriber_stalls": "Times a subscriber's queue (kv_events_hwm batches) was found full: from then until it "
                         "reads again it loses batches (it sees the gap in the sequence numbers and may replay)",
    "queue_dropped_events": "Store events lost before publishing (kv_events_queue full); each loss is followed by "
                            "AllBlocksCleared and a snapshot",
    "replay_requests": "Replay requests answered",
    "replay_refused": "Replay requests refused: malformed or an unknown topic (answered with the end marker)",
    "unknown_topic_subscriptions": "Subscriptions to a topic prefix no namespace had published on",
    "origins_kept": "vLLM block identities received (Annotate)",
    "origins_dropped": "vLLM block identities dropped unused (no put followed before the book filled)",
}
