"""The connector's counter vocabularies that more than one module names: miss causes and hint outcomes.

They live apart from the modules that count them (misses.py, hints.py) and the one that keeps the counters
(stats.py), so that each of those depends on this file and on stats.py, and stats.py on this file only: no
module of the connector imports one that imports it back (tests/test_import_graph.py).
"""

from __future__ import annotations

from kvstore.hint_vocab import HintOutcome

__all__ = ["DAEMON_CAUSES", "CONNECTOR_CAUSES", "MISS_CAUSES", "HINT_COUNTERS", "STORE_DOWN", "LOOKUP_FAILED",
           "STREAM_MODE", "LOAD_FAILED", "UNEXPLAINED"]

STORE_DOWN, LOOKUP_FAILED, STREAM_MODE, LOAD_FAILED, UNEXPLAINED = (
    "store_down", "lookup_failed", "stream_mode", "load_failed", "unexplained")
#: causes the daemon's explain names for an absent key (kvstore/engine/misses.py)
DAEMON_CAUSES = ("never_stored", "evicted", "disk_reclaimed", "deleted", "cleared", "other_namespace")
#: causes the connector knows without asking (kvstore_connector/misses.py)
CONNECTOR_CAUSES = (STORE_DOWN, LOOKUP_FAILED, STREAM_MODE, LOAD_FAILED, UNEXPLAINED)
MISS_CAUSES = DAEMON_CAUSES + CONNECTOR_CAUSES

#: the connector's hint counters (kvstore_connector/hints.py): one per outcome, then the ones only the connector knows
HINT_COUNTERS: tuple[str, ...] = tuple("hint_" + o.value for o in HintOutcome) + (
    "hint_malformed", "hint_failed", "hint_dropped", "hint_empty", "session_noted", "session_note_failed")
