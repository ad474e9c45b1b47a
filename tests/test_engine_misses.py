"""Why a key is missing (kvstore/engine/misses.py, miss_causes.py): the ledger's bound and records, every cause
produced by a real Engine (RAM rig: tests/engine_helpers.py; RAM + disk rig: tests/tiering_rig.py), explain's
exact fields, the misses_* counters adding up to the prefix Lookups that stopped short, and
kvstore_misses_total{cause} on a real daemon's /metrics. Times come from a clock the test moves, so ages are
exact values.
"""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.engine.config import EngineConfig
from kvstore.engine.misses import CAUSES, KeyExplanation, MissLedger
from kvstore.errors import ConfigError, InvalidRequestError, UnknownNamespaceError
from kvstore.server.config import ServerConfig
from kvstore.testing import DaemonProcess
from kvstore.vocab import Tier
from tests.engine_helpers import NO_WATERMARKS, NS, make_rig, put
from tests.tiering_rig import NS as NS_DISK
from tests.tiering_rig import MiB, rig_fixture

pytestmark = pytest.mark.timeout(60)
disk_rig = rig_fixture()
NS2 = "m@2/default"
ZERO = {"misses_" + c: 0 for c in CAUSES}
A, B = "miss/a", "miss/b"


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _misses(eng) -> dict[str, int]:
    c = eng.stats().counters
    return {name: c[name] for name in ZERO}


def _k(i: int) -> bytes:
    return b"k%02d" % i


# ------------------------------------------------------------------------------------------- the ledger


def test_ledger_forgets_the_oldest_beyond_its_capacity_and_a_newer_record_moves_to_the_end() -> None:
    clock = Clock()
    led = MissLedger(3, clock)
    led.left(0, [b"a", b"b"], "evicted")        # t=1000.0
    clock.t = 1001.5
    led.left(0, [b"c"], "deleted")
    led.left(0, [b"a"], "disk_reclaimed")        # a again: newest now, with its new cause
    assert len(led) == 3
    led.left(1, [b"d"], "evicted")               # the 4th key: b (the oldest) is forgotten
    assert len(led) == 3
    clock.t = 1004.0
    assert led.why(0, b"b") is None
    assert led.why(0, b"a") == ("disk_reclaimed", 2.5)
    assert led.why(0, b"c") == ("deleted", 2.5)
    assert led.why(1, b"d") == ("evicted", 2.5)
    assert led.why(0, b"d") is None              # namespaces are apart: d left namespace 1 only
    led.left(1, [b"e"], "evicted")               # capacity N: the N+1th removal forgets the oldest (c)
    assert led.why(0, b"c") is None and led.why(0, b"a") == ("disk_reclaimed", 2.5)


def test_ledger_stored_again_leaves_and_a_clear_is_one_record_per_namespace() -> None:
    clock = Clock()
    led = MissLedger(10, clock)
    led.left(0, [b"a", b"b"], "evicted")
    led.stored(0, [b"a", b"zz"])                 # a is back; zz was never recorded
    led.stored(1, [b"b"])                        # b of another namespace: namespace 0's record stays
    assert len(led) == 1 and led.why(0, b"a") is None and led.why(0, b"b") == ("evicted", 0.0)
    clock.t = 1002.0
    led.cleared(0)                               # a Clear after b's eviction: b reads "cleared"
    clock.t = 1003.0
    led.left(0, [b"c"], "deleted")               # a record after the Clear wins over it
    clock.t = 1007.0
    assert led.why(0, b"b") == ("cleared", 5.0)
    assert led.why(0, b"c") == ("deleted", 4.0)
    assert led.why(0, b"never") == ("cleared", 5.0)  # absent after a Clear, no record: said "cleared"
    assert led.why(1, b"b") is None
    assert len(led) == 2                         # the Clear added no per-key record


def test_ledger_of_capacity_zero_records_nothing() -> None:
    led = MissLedger(0)
    led.left(0, [b"a"], "evicted")
    led.cleared(0)
    assert (len(led), led.enabled, led.why(0, b"a")) == (0, False, None)
    with pytest.raises(ValueError, match="must be >= 0"):
        MissLedger(-1)


def test_the_capacity_setting_reaches_the_engine_and_is_checked() -> None:
    assert ServerConfig().engine_config().miss_ledger_keys == 262144
    assert ServerConfig(miss_ledger_keys=5).engine_config().miss_ledger_keys == 5
    with pytest.raises(ConfigError, match="miss_ledger_keys=-1: use 0..16777216"):
        EngineConfig(max_block_bytes=4096, miss_ledger_keys=-1)


# ------------------------------------------------------------------------- causes from a real RAM engine


def test_every_ram_cause_counted_and_explained_with_exact_values() -> None:
    rig = make_rig(**NO_WATERMARKS)               # 4 slots of 1 MiB, LRU
    eng, clock = rig.engine, Clock()
    eng.misses.clock = clock
    assert eng.register_namespace(NS2) is True
    put(eng, [_k(0), _k(1), _k(2), _k(3)])        # t=1000
    put(eng, [_k(4)])                             # evicts k00 (least recent), no disk copy: "evicted"
    clock.t = 1010.0
    assert eng.delete(NS, [_k(1), b"nope"]) == 1  # k01 "deleted"; nope was nowhere: no record
    put(eng, [b"x"], ns=NS2)                      # into k01's slot: x lives in NS2 only
    put(eng, [_k(5)])                             # evicts k02 (least recent of k02-k04, x) at t=1010
    clock.t = 1012.0
    # prefix lookups that stop short, one per cause: each counts its FIRST missing key only
    assert eng.lookup(NS, [_k(3), _k(0), _k(1)], prefix=True, lease=False).num_prefix == 1  # k00: evicted
    assert eng.lookup(NS, [_k(1), _k(0)], prefix=True, lease=False).num_prefix == 0         # k01: deleted
    assert eng.lookup(NS, [b"x"], prefix=True, lease=True).num_prefix == 0                  # other_namespace
    assert eng.lookup(NS, [b"never", _k(4)], prefix=True, lease=False).num_prefix == 0      # never_stored
    assert eng.lookup(NS, [_k(3), _k(4)], prefix=True, lease=False).num_prefix == 2         # whole: no count
    assert eng.lookup(NS, [_k(0), b"never"], prefix=False, lease=False).present == [False, False]  # no prefix
    assert _misses(eng) == {**ZERO, "misses_evicted": 1, "misses_deleted": 1, "misses_other_namespace": 1,
                            "misses_never_stored": 1}
    assert eng.explain(NS, [_k(0), _k(1), _k(2), _k(3), b"x", b"never", b"nope"]) == [
        KeyExplanation(Tier.NONE, "evicted", 12.0, "lru", ()),
        KeyExplanation(Tier.NONE, "deleted", 2.0, "", ()),
        KeyExplanation(Tier.NONE, "evicted", 2.0, "lru", ()),
        KeyExplanation(Tier.RAM),
        KeyExplanation(Tier.NONE, "other_namespace", 0.0, "", (NS2,)),
        KeyExplanation(Tier.NONE, "never_stored", 0.0, "", ()),
        KeyExplanation(Tier.NONE, "never_stored", 0.0, "", ()),
    ]
    assert eng.explain(NS2, [b"x", _k(3)]) == [KeyExplanation(Tier.RAM),
                                               KeyExplanation(Tier.NONE, "other_namespace", 0.0, "", (NS,))]
    assert _misses(eng)["misses_evicted"] == 1    # explain counts nothing
    # a Clear: one record for the namespace; a key evicted before it now reads "cleared"
    clock.t = 1020.0
    assert eng.clear_namespace(NS) == 3           # k03, k04, k05
    clock.t = 1021.5
    assert eng.explain(NS, [_k(0), _k(3)]) == [KeyExplanation(Tier.NONE, "cleared", 1.5, "", ())] * 2
    assert eng.lookup(NS, [_k(3)], prefix=True, lease=False).num_prefix == 0
    assert _misses(eng)["misses_cleared"] == 1


def test_a_key_stored_again_leaves_the_ledger() -> None:
    rig = make_rig(**NO_WATERMARKS)
    eng = rig.engine
    eng.misses.clock = Clock()
    put(eng, [_k(0), _k(1), _k(2), _k(3)])
    put(eng, [_k(4), _k(5)])                      # evicts k00, k01
    assert len(eng.misses) == 2
    put(eng, [_k(0)])                             # k00 back (evicting k02): its record goes, k02's comes
    assert len(eng.misses) == 2
    assert eng.explain(NS, [_k(0), _k(1), _k(2)]) == [
        KeyExplanation(Tier.RAM), KeyExplanation(Tier.NONE, "evicted", 0.0, "lru", ()),
        KeyExplanation(Tier.NONE, "evicted", 0.0, "lru", ())]


def test_with_the_ledger_off_an_evicted_key_is_never_stored_or_held_elsewhere() -> None:
    rig = make_rig(**NO_WATERMARKS, miss_ledger_keys=0)
    eng = rig.engine
    assert eng.register_namespace(NS2) is True
    put(eng, [_k(0)], ns=NS2)
    put(eng, [_k(0), _k(1), _k(2)])
    put(eng, [_k(3), _k(4)])                      # evicts k00 of NS2, then k00 of NS (LRU order)
    eng.delete(NS, [_k(1)])
    eng.clear_namespace(NS2)
    assert len(eng.misses) == 0
    assert [e.cause for e in eng.explain(NS, [_k(0), _k(1), _k(3)])] == ["never_stored", "never_stored", ""]
    put(eng, [_k(1)], ns=NS2)
    assert eng.explain(NS, [_k(1)]) == [KeyExplanation(Tier.NONE, "other_namespace", 0.0, "", (NS2,))]


def test_counters_add_up_to_the_prefix_lookups_that_stopped_short() -> None:
    rig = make_rig(**NO_WATERMARKS, miss_ledger_keys=3)  # a small ledger: some evictions are forgotten
    eng = rig.engine
    assert eng.register_namespace(NS2) is True
    stopped = 0
    for i in range(12):                           # 12 keys through 4 slots: 5 evictions, 4 deletes
        put(eng, [_k(i)])
        if i % 3 == 2:
            eng.delete(NS, [_k(i)])
    put(eng, [_k(0)], ns=NS2)
    for first in range(14):
        chain = [_k(j) for j in range(first, 14)]
        for lease in (False, True):
            res = eng.lookup(NS, chain, prefix=True, lease=lease)
            if res.lease_id:
                eng.release([res.lease_id])
            stopped += res.num_prefix < len(chain)
    # LRU through 4 slots, ledger of 3 (newest last): k02 deleted; k00 evicted; k05 deleted; k01 evicted (k02
    # forgotten); k03 evicted; k08 deleted; k04 evicted; k06 evicted; k11 deleted -> the ledger holds k04, k06
    # (evicted) and k11 (deleted); RAM holds k07, k09, k10 of NS and k00 of NS2.
    assert [i for i in range(14) if eng.exists(NS, [_k(i)])[0]] == [7, 9, 10]
    assert [e.cause for e in eng.explain(NS, [_k(i) for i in range(14)])] == [
        "other_namespace", "never_stored", "never_stored", "never_stored", "evicted", "never_stored", "evicted",
        "", "never_stored", "", "", "deleted", "never_stored", "never_stored"]
    # every chain stops short (k12, k13 were never stored), at the first of them not in RAM; x2 (lease or not)
    assert stopped == 28
    assert _misses(eng) == {**ZERO, "misses_other_namespace": 2, "misses_never_stored": 16, "misses_evicted": 4,
                            "misses_deleted": 6}
    assert sum(_misses(eng).values()) == stopped


def test_explain_is_validated_like_the_other_operations() -> None:
    eng = make_rig().engine
    with pytest.raises(UnknownNamespaceError, match="register it first"):
        eng.explain("m@9/none", [b"a"])
    with pytest.raises(InvalidRequestError, match="64"):
        eng.explain(NS, [b"x" * 65])
    with pytest.raises(InvalidRequestError, match="empty key batch"):
        eng.explain(NS, [])


# ------------------------------------------------------------------------- causes with the disk tier


def test_disk_reclamation_and_a_failed_promotion_with_the_disk_tier(disk_rig) -> None:
    # Disk: 2 segments of 16 blocks, plain FIFO. k00..k31 fill both; k32's write reclaims segment A (k00-k15):
    # those with no RAM copy leave the store ("disk_reclaimed"); RAM holds k29-k31, k32 (evicted blocks kept a
    # disk copy: no record).
    rig = disk_rig(disk_bytes=2 * MiB, reinsert_hits=0)
    eng, clock = rig.engine, Clock()
    eng.misses.clock = clock
    for i in range(0, 32, 4):
        rig.put([_k(j) for j in range(i, i + 4)])
        rig.wait_written(i + 4)
    assert len(eng.misses) == 0                   # 28 evictions, each with a disk copy
    clock.t = 1003.0
    rig.put([_k(32)])
    rig.wait_written(33)
    clock.t = 1005.0
    assert len(eng.misses) == 16
    assert eng.explain(NS_DISK, [_k(0), _k(15), _k(16), _k(31)]) == [
        KeyExplanation(Tier.NONE, "disk_reclaimed", 2.0, "", ()),
        KeyExplanation(Tier.NONE, "disk_reclaimed", 2.0, "", ()),
        KeyExplanation(Tier.DISK), KeyExplanation(Tier.RAM)]
    assert eng.lookup(NS_DISK, [_k(0)], prefix=True, lease=False).num_prefix == 0
    # every RAM slot pinned: k16's promotion finds no room, so the probe stops there although it is stored
    assert eng.pin(NS_DISK, [_k(29), _k(30), _k(31), _k(32)], +1) == 4
    assert eng.lookup(NS_DISK, [_k(31), _k(16)], prefix=True, lease=False).num_prefix == 1
    assert eng.lookup(NS_DISK, [_k(16)], prefix=True, lease=True).num_prefix == 0
    assert _misses(eng) == {**ZERO, "misses_disk_reclaimed": 1, "misses_load_failed": 2}


def test_a_probe_cut_short_by_a_failed_promotion_carries_only_the_prefixs_hits(disk_rig) -> None:
    """A prefix Lookup without lease whose disk hit cannot be promoted (every RAM slot is this lookup's or pinned)
    ends there; a RAM hit after it is not in the answer (it was: 2 hits among 2 keys looked at, and the fast path's
    client refused the reply as garbled)."""
    from kvstore.fastpath import protocol as fp

    rig = disk_rig(disk_bytes=4 * MiB, reinsert_hits=0)
    eng = rig.engine
    for i in range(0, 8, 4):
        rig.put([_k(j) for j in range(i, i + 4)])
        rig.wait_written(i + 4)
    assert eng.explain(NS_DISK, [_k(0), _k(7)]) == [KeyExplanation(Tier.DISK), KeyExplanation(Tier.RAM)]
    assert eng.pin(NS_DISK, [_k(4), _k(5), _k(6), _k(7)], +1) == 4          # no room left for a promotion
    r = eng.lookup(NS_DISK, [_k(7), _k(0), _k(6)], prefix=True, lease=False)
    assert (r.num_prefix, r.present, r.tiers) == (1, [True, False], [Tier.RAM, Tier.DISK])
    assert len(r.offsets) == len(r.sizes) == 1
    body = fp.encode_lookup_reply(r.num_prefix, r.present, r.tiers, r.lease_id, 0, 1, r.offsets, r.sizes,
                                  r.generations, r.checksums)
    assert fp.decode_lookup_reply(body).num_prefix == 1                     # the client takes it


# ----------------------------------------------------------------------------------- /metrics, a daemon


def _scrape_misses(d: DaemonProcess) -> dict[str, float]:
    with urllib.request.urlopen(d.metrics_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.labels["cause"]: s.value for fam in text_string_to_metric_families(text)
            if fam.name == "kvstore_misses" for s in fam.samples if s.name == "kvstore_misses_total"}


def test_metrics_count_misses_by_cause(make_daemon) -> None:
    d = make_daemon(arena_bytes="4MiB", max_block_bytes="1MiB", high_watermark=1.0, low_watermark=1.0,
                    disk_bytes=0)
    assert _scrape_misses(d) == dict.fromkeys(CAUSES, 0)
    block = b"v" * (1 << 20)
    with d.client() as c:
        c.register_namespace(A)
        c.register_namespace(B)
        c.put_many(A, [b"a0", b"a1", b"a2", b"a3"], [block] * 4)   # 4 slots of 1 MiB: full
        c.put(A, b"a4", block)                  # evicts a0
        assert c.delete(A, [b"a1"]) == 1
        c.put(B, b"b0", block)                  # into a1's slot
        c.put(A, b"a5", block)                  # evicts a2
        assert c.clear(B) == 1
        c.put(B, b"o", block)                   # into b0's slot
        assert c.lookup_prefix(A, [b"a3", b"a0"]) == 1      # evicted
        assert c.lookup_prefix(A, [b"a2"]) == 0             # evicted
        assert c.lookup_prefix(A, [b"a1", b"a3"]) == 0      # deleted
        assert c.lookup_prefix(B, [b"b0"]) == 0             # cleared
        assert c.lookup_prefix(A, [b"o"]) == 0              # other_namespace
        assert c.lookup_prefix(A, [b"zz"]) == 0             # never_stored
        assert c.lookup_prefix(A, [b"a3", b"a4"]) == 2      # the whole prefix: not a miss
        counters = c.stats().counters
    assert _scrape_misses(d) == {"never_stored": 1, "evicted": 2, "disk_reclaimed": 0, "deleted": 1, "cleared": 1,
                                 "other_namespace": 1, "load_failed": 0}
    assert {k: v for k, v in counters.items() if k.startswith("misses_")} == {
        "misses_never_stored": 1, "misses_evicted": 2, "misses_disk_reclaimed": 0, "misses_deleted": 1,
        "misses_cleared": 1, "misses_other_namespace": 1, "misses_load_failed": 0}
