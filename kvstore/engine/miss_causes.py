"""The cause of a miss, from the miss ledger and the catalog: counted per prefix Lookup, told per key by explain.

`count` runs once for every prefix Lookup that stops short (the scheduler's probe, a prefix get), on its first
missing key only, so the hot path pays one comparison when a Lookup finds its whole prefix and a ledger read
plus a scan of the other namespaces' RAM indexes (one dict probe each) when it does not. Exactly one counter
`misses_<cause>` is bumped per such Lookup, so the counters add up to the Lookups that stopped short.

The order of the questions (the first that answers wins): present in a tier but not served -> load_failed; a
record in the ledger (the latest removal, or a later Clear) -> its cause; held by another namespace now ->
other_namespace; else never_stored. A record beats another namespace: it is a fact about this namespace.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.engine.catalog import Catalog, EntryState, Namespace
from kvstore.engine.counters import Counters
from kvstore.engine.misses import (COUNTER_OF, EVICTED, LOAD_FAILED, NEVER_STORED, OTHER_NAMESPACE, KeyExplanation,
                                   MissLedger)
from kvstore.vocab import Tier

__all__ = ["MissCauses"]

_NONE = int(Tier.NONE)
_LIVE = (int(EntryState.COMMITTED), int(EntryState.PROMOTING))  # states a Lookup can find


class MissCauses:
    """Attributes misses to causes. Called under the engine's lock."""

    def __init__(self, cat: Catalog, ledger: MissLedger, counters: Counters, policy_name: str) -> None:
        self._cat = cat
        self.ledger = ledger
        self._counters = counters
        self._policy = policy_name

    def count(self, ns: Namespace, key: bytes, tier: int) -> str:
        """The cause of a prefix Lookup's first miss (`tier`: where the Lookup found it), counted; returned."""
        cause = self._cause(ns, key, tier)[0]
        name = COUNTER_OF[cause]
        setattr(self._counters, name, getattr(self._counters, name) + 1)
        return cause

    def explain(self, ns: Namespace, keys: Sequence[bytes], tiers: Sequence[int]) -> list[KeyExplanation]:
        """Per key: where it lives (`tiers`, from Lookups.locate), or why it is absent. Counts nothing."""
        out: list[KeyExplanation] = []
        for key, tier in zip(keys, tiers):
            if tier != _NONE:
                out.append(KeyExplanation(Tier(tier)))
                continue
            cause, age_s = self._cause(ns, key, tier)
            out.append(KeyExplanation(Tier.NONE, cause, age_s, self._policy if cause == EVICTED else "",
                                      self._holders(ns, key)))
        return out

    def _cause(self, ns: Namespace, key: bytes, tier: int) -> tuple[str, float]:
        if tier != _NONE:
            return LOAD_FAILED, 0.0
        recorded = self.ledger.why(ns.id, key)
        if recorded is not None:
            return recorded
        return (OTHER_NAMESPACE if self._held_elsewhere(ns, key) else NEVER_STORED), 0.0

    def _held_elsewhere(self, ns: Namespace, key: bytes) -> bool:
        state = self._cat.state
        for other in self._cat.namespaces:
            if other is not ns:
                eid = other.index.get(key)
                if eid is not None and state[eid] in _LIVE:
                    return True
        return False

    def _holders(self, ns: Namespace, key: bytes) -> tuple[str, ...]:
        state = self._cat.state
        return tuple(o.name for o in self._cat.namespaces
                     if o is not ns and (eid := o.index.get(key)) is not None and state[eid] in _LIVE)
