"""The hint vocabulary: what an agent runtime may ask of the cache (HintAction) and what each key's answer is
(HintOutcome). One closed set for every way in (the engine, the daemon's RPC, the client, the CLI, the vLLM
connector), as str Enums: a value is the word on the wire, in counters (hint_<action>_<outcome>) and in logs.

This module imports nothing from kvstore: every other module may import it.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["HintAction", "HintOutcome", "HINT_COUNTER_NAMES"]


class HintAction(StrEnum):
    """What a hint asks (kvstore/engine/hints.py says what the engine does with each)."""

    RETAIN = "retain"      # keep in RAM for ttl_s (<= hint_max_ttl_s) while anything else can go; not a pin
    RELEASE = "release"    # done with it: first to go from RAM
    DEMOTE = "demote"      # move to the disk tier now and free the RAM copy
    PREFETCH = "prefetch"  # bring from disk or a peer into RAM before it is read
    PIN = "pin"            # never evicted for ttl_s, counted against the tenant's RAM quota


class HintOutcome(StrEnum):
    """One key's answer to a hint."""

    ACCEPTED = "accepted"  # done (or already so)
    CLIPPED = "clipped"    # done, with ttl_s cut to hint_max_ttl_s
    DEFERRED = "deferred"  # under way: it completes when a pending disk write, promotion or Commit lands
    REJECTED = "rejected"  # refused: no disk tier, quota exhausted, pinned, not in RAM, no room
    MISSING = "missing"    # the key is not stored in any tier


#: The engine's counters of hint outcomes, hint_<action>_<outcome>, every pair (kvstore/engine/counters.py).
HINT_COUNTER_NAMES: tuple[str, ...] = tuple(f"hint_{a.value}_{o.value}" for a in HintAction for o in HintOutcome)
