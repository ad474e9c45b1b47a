"""A leased Lookup with the peer tier attached (Engine.lookup): a block the peer tier's fill found here, or
fetched, and that was let go before the Lookup's lease took it (its owner confirmed holding it: peer/guests.py)
is fetched again, once, instead of being reported missing.

The peer tier here is a small real implementation of the engine's RemoteHooks: its fill reports what it finds
in the engine and, the first time, lets the named keys go right after it looked (what a hand-off landing
concurrently does), and puts them back when asked again (what a fetch from their owner does).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.engine.engine import Engine
from kvstore.engine.results import Filled
from tests.engine_helpers import NS, put
from tests.test_engine_hints import make_engine


class _LetGoAfterFill:
    def __init__(self, eng: Engine, drop: list[bytes]) -> None:
        self.eng, self.drop = eng, drop
        self.fills: list[list[bytes]] = []
        self.loaded_keys: list[list[bytes]] = []

    def fill(self, namespace: str, keys: Sequence[bytes]) -> Filled:
        self.fills.append(list(keys))
        back = [k for k in keys if k in self.drop]
        if len(self.fills) > 1 and back:   # the owner's copy comes back
            put(self.eng, back)
        here = frozenset(k for k, p in zip(keys, self.eng.exists(namespace, keys)) if p)
        if len(self.fills) == 1 and self.drop:   # let go right after this fill looked
            assert self.eng.let_go(namespace, self.drop, drop=True) == len(self.drop)
        return Filled(0, here)

    def loaded(self, namespace: str, keys: Sequence[bytes]) -> None:
        self.loaded_keys.append(list(keys))

    def prefetch(self, namespace: str, keys: Sequence[bytes], prefix: bool) -> list[bool]:
        return [False] * len(keys)

    def committed(self, reservation_id: int, namespace: str, keys: Sequence[bytes]) -> None:
        pass

    def held_elsewhere(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        return [False] * len(keys)

    def claim(self, namespace: str, keys: Sequence[bytes], claimant: bytes, ttl_ms: int) -> dict[bytes, int]:
        return {}


def test_a_block_let_go_between_fill_and_the_lease_is_fetched_again_once() -> None:
    eng, _ = make_engine()
    put(eng, [b"a", b"b", b"c"])
    remote = _LetGoAfterFill(eng, [b"b"])
    eng.attach_remote(remote)
    res = eng.lookup(NS, [b"a", b"b", b"c"], prefix=True)
    assert (res.num_prefix, res.present) == (3, [True, True, True])
    assert remote.fills == [[b"a", b"b", b"c"], [b"b"]]
    assert remote.loaded_keys == [[b"a", b"b", b"c"]]
    assert eng.stats().leases_active == 1          # the first lease was released, not left to expire
    assert eng.release([res.lease_id]) == 1


def test_a_block_that_was_never_here_is_not_asked_for_twice() -> None:
    eng, _ = make_engine()
    put(eng, [b"a"])
    remote = _LetGoAfterFill(eng, [])
    eng.attach_remote(remote)
    res = eng.lookup(NS, [b"a", b"z", b"c"], prefix=True)
    assert (res.num_prefix, res.present) == (1, [True, False])
    res2 = eng.lookup(NS, [b"a", b"z"], prefix=False)
    assert res2.present == [True, False]
    assert remote.fills == [[b"a", b"z", b"c"], [b"a", b"z"]]   # one fill per Lookup: a genuine miss
    eng.release([res.lease_id, res2.lease_id])
