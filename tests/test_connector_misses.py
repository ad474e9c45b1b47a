"""Why a request missed (issue 15 item 2): the connector's scheduler side counts one cause per request the store
did not fully serve (kvstore_connector/misses.py), against a real daemon and the CPU rig of tests/connector_helpers.py,
over the fast path and over gRPC. Causes only the daemon knows are asked with Client.explain off the scheduler's
thread; `misses.flush()` waits for them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvstore_connector.config import ConnectorConfig
from kvstore_connector.keys import KeyChain, chain_root
from kvstore_connector.link import StoreLink
from kvstore_connector.misses import MissExplainer, MissRecord, MissTarget
from kvstore_connector.namespace import StageLayouts, namespace_for, registration
from kvstore_connector.scheduler import ScheduledRequest, SchedulerSide
from kvstore_connector.stats import COUNTER_NAMES, MISS_COUNTERS, ConnectorCounters, miss_summary
from kvstore.client import Client
from kvstore.testing import free_port, wait_until
from tests.connector_helpers import SPEC, T, Req, Side, make_caches, prompt_tokens
from tests.control_paths import per_path_daemon
from tests.test_connector_hybrid_sides import PROMPT_LEN, SPECS, SRC_TABLES, HybridSide, chain
from tests.test_connector_hybrid_sides import make_caches as hybrid_caches

pytestmark = pytest.mark.usefixtures("control_path")  # every test over the fast path and over gRPC
daemon = per_path_daemon()


def misses(side: SchedulerSide) -> dict[str, float]:
    """The miss counters a scheduler side has counted, once every queued miss is explained."""
    assert side.misses.flush(timeout_s=20.0), "the explain thread did not count its queued misses in 20 s"
    return {k: v for k, v in side.counters.totals.items() if k.startswith("miss_")}




def keys_of(prompt: list[int]) -> list[bytes]:
    return KeyChain(T, 0, chain_root(0)).extend(prompt)


def stored(address: str, start: int, salt: str | None = None, seed: int = 300) -> list[int]:
    """A 100-token prompt (12 stored keys) saved through a connector; its tokens."""
    s = Side(address, make_caches(seed))
    req = Req(f"store-{start}", prompt_tokens(100, start=start), cache_salt=salt)
    s.prefill(req, list(range(25)))
    assert s.worker.counters.totals["saved_blocks"] == 12
    s.close()
    return req.prompt_token_ids


def test_counter_names_cover_every_cause() -> None:
    assert MISS_COUNTERS == ("miss_never_stored", "miss_evicted", "miss_disk_reclaimed", "miss_deleted",
                             "miss_cleared", "miss_other_namespace", "miss_store_down", "miss_lookup_failed",
                             "miss_stream_mode", "miss_load_failed", "miss_unexplained")
    assert set(MISS_COUNTERS) <= set(COUNTER_NAMES)
    assert miss_summary({"miss_evicted": 2, "miss_store_down": 1, "hit_tokens": 9}) == {"miss_causes": 3}
    assert miss_summary({"hit_tokens": 9}) == {}


# -- causes the daemon knows -----------------------------------------------------------------------------------
def test_a_fresh_prompt_was_never_stored(daemon) -> None:
    s = Side(daemon.address, make_caches(301))
    assert s.sched.num_new_matched_tokens(Req("n1", prompt_tokens(40, start=611)), 0) == (0, False)
    assert misses(s.sched) == {"miss_never_stored": 1}
    assert list(s.sched.misses.recent) == [MissRecord("n1", "never_stored", namespace_for(SPEC))]
    s.close()


def test_a_deleted_key_is_the_cause_of_a_partial_hit(daemon) -> None:
    prompt = stored(daemon.address, 622)
    with Client(daemon.address) as c:
        assert c.delete(namespace_for(SPEC), keys_of(prompt)[3:4]) == 1
    s = Side(daemon.address, make_caches(302))
    assert s.sched.num_new_matched_tokens(Req("d1", prompt), 0) == (24, True)    # keys 0-2 served
    assert misses(s.sched) == {"miss_deleted": 1}
    (rec,) = s.sched.misses.recent
    assert (rec.req_id, rec.cause, rec.namespace, rec.policy, rec.other_namespaces) == (
        "d1", "deleted", namespace_for(SPEC), "", ())
    assert 0.0 <= rec.age_s < 60.0
    s.close()


def test_the_same_prompt_under_another_cache_salt_is_held_by_another_namespace(daemon) -> None:
    prompt = stored(daemon.address, 633, salt="tenant-a")
    s = Side(daemon.address, make_caches(303))
    assert s.sched.num_new_matched_tokens(Req("o1", prompt, cache_salt="tenant-b"), 0) == (0, False)
    assert misses(s.sched) == {"miss_other_namespace": 1}
    (rec,) = s.sched.misses.recent
    assert rec == MissRecord("o1", "other_namespace", namespace_for(SPEC, "tenant-b"),
                             other_namespaces=(namespace_for(SPEC, "tenant-a"),))
    s.close()


def test_the_same_prompt_under_another_model_is_held_by_another_namespace(daemon) -> None:
    prompt = stored(daemon.address, 644)
    other = replace(SPEC, model="org/other")
    config = ConnectorConfig.from_extra({"address": daemon.address, "blocks_per_key": 2})
    sched = SchedulerSide(config, other, StoreLink(daemon.address, timeout_s=5.0,
                                                   namespace_spec=lambda _n: registration(other)))
    assert sched.num_new_matched_tokens(Req("m1", prompt), 0) == (0, False)
    assert misses(sched) == {"miss_other_namespace": 1}
    (rec,) = sched.misses.recent
    assert rec == MissRecord("m1", "other_namespace", namespace_for(other), other_namespaces=(namespace_for(SPEC),))


def test_keys_pushed_out_of_a_full_arena_were_evicted(make_daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    # the filler takes the whole arena: no connection may hold spare slots (the connector's saves would keep a
    # slab of their size class until their connection's quarantine is over)
    monkeypatch.setenv("KVSTORE_SPARE_SLOTS", "0")
    d = make_daemon(arena_bytes="4MiB", max_block_bytes="1MiB", high_watermark=1.0, low_watermark=1.0, disk_bytes=0)
    prompt = stored(d.address, 655)
    with Client(d.address) as c:
        c.register_namespace("filler")
        c.put_many("filler", [b"f0", b"f1", b"f2", b"f3"], [b"x" * (1 << 20)] * 4)   # the whole arena
        assert c.exists(namespace_for(SPEC), keys_of(prompt)) == [False] * 12
    s = Side(d.address, make_caches(304))
    assert s.sched.num_new_matched_tokens(Req("e1", prompt), 0) == (0, False)
    assert misses(s.sched) == {"miss_evicted": 1}
    (rec,) = s.sched.misses.recent
    assert (rec.req_id, rec.cause, rec.namespace, rec.policy, rec.other_namespaces) == (
        "e1", "evicted", namespace_for(SPEC), "lru", ())
    s.close()


def test_the_first_pipeline_stage_that_stops_short_is_asked(daemon) -> None:
    """Two stages hold the whole prompt; stage 1 loses key 3: the miss is stage 1's, deleted (a record of this
    namespace beats stage 0 holding the same key)."""
    s0, s1 = replace(SPEC, num_layers=2, first_layer=0), replace(SPEC, num_layers=1, first_layer=2)
    stages = StageLayouts([s0, s1])
    config = ConnectorConfig.from_extra({"address": daemon.address, "blocks_per_key": 2})
    sched = SchedulerSide(config, s0, StoreLink(daemon.address, timeout_s=5.0, namespace_spec=stages.registration),
                          stages=stages)
    prompt = prompt_tokens(60, start=666)                          # 7 usable keys
    keys = keys_of(prompt)
    n0, n1 = stages.names()
    with Client(daemon.address) as c:
        for name, spec in ((n0, s0), (n1, s1)):
            c.register_namespace(name, **registration(spec))
            c.put_many(name, keys[:7], [bytes(2 * spec.block_bytes)] * 7)
        assert c.delete(n1, keys[3:4]) == 1
    assert sched.num_new_matched_tokens(Req("p1", prompt), 0) == (24, False)
    assert misses(sched) == {"miss_deleted": 1}
    assert [(r.cause, r.namespace) for r in sched.misses.recent] == [("deleted", n1)]


def test_a_hybrid_models_miss_is_the_group_that_stops_short(daemon) -> None:
    """Full + sliding-window groups (tests/test_connector_hybrid_sides.py: 6 keys, window 12 tokens), every key
    saved in both. The sliding group loses key 4: a hit of 5 or 6 keys needs it, so 4 keys are served and the
    sliding group's key 4 is blamed. Then the full group loses key 3 (sliding keys 1, 2 cover a 3-key hit): the
    full group's key 3 is blamed."""
    a = HybridSide(daemon.address, hybrid_caches(311, False), window_save="all")
    prompt, salt = prompt_tokens(PROMPT_LEN, start=788), "hybrid"
    a.prefill(Req("h0", prompt, cache_salt=salt), SRC_TABLES)
    keys, (ns0, ns1) = chain(prompt), [namespace_for(spec, salt) for spec in SPECS]
    b = HybridSide(daemon.address, hybrid_caches(312, False))
    with Client(daemon.address) as c:
        assert c.delete(ns1, keys[4:5]) == 1
        assert b.sched.num_new_matched_tokens(Req("h1", prompt, cache_salt=salt), 0) == (32, True)
        assert misses(b.sched) == {"miss_deleted": 1}
        assert c.delete(ns0, keys[3:4]) == 1
        assert b.sched.num_new_matched_tokens(Req("h2", prompt, cache_salt=salt), 0) == (24, True)
    assert misses(b.sched) == {"miss_deleted": 2}
    assert [(r.req_id, r.namespace) for r in b.sched.misses.recent] == [("h1", ns1), ("h2", ns0)]
    a.close(), b.close()


# -- causes the connector knows --------------------------------------------------------------------------------
def test_a_stopped_daemon_is_store_down(make_daemon) -> None:
    d = make_daemon(arena_bytes="64MiB", max_block_bytes="4MiB")
    s = Side(d.address, make_caches(305), lookup_timeout_s=0.5)
    prompt = prompt_tokens(40, start=677)
    assert s.sched.num_new_matched_tokens(Req("u0", prompt), 0) == (0, False)   # connected; never stored
    s.sched.misses.flush()
    before = {k: v for k, v in s.sched.counters.totals.items() if k.startswith("miss_")}
    d.stop()
    for i in range(3):
        assert s.sched.num_new_matched_tokens(Req(f"u{i + 1}", prompt), 0) == (0, False)
    after = misses(s.sched)
    assert {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)} == {"miss_store_down": 3}
    s.close()


def test_an_address_with_no_daemon_is_store_down() -> None:
    s = Side(f"127.0.0.1:{free_port()}", make_caches(306), lookup_timeout_s=0.2)
    for i in range(2):
        assert s.sched.num_new_matched_tokens(Req(f"a{i}", prompt_tokens(40, start=688)), 0) == (0, False)
    assert s.sched.num_new_matched_tokens(Req("short", [1, 2, 3]), 0) == (0, False)   # no usable key: no miss
    assert misses(s.sched) == {"miss_store_down": 2}
    s.close()


def test_a_refused_lookup_is_lookup_failed(daemon) -> None:
    """The request's namespace exists with another tokens_per_block: registering it is refused (not a store
    that is down), so the lookup call fails."""
    with Client(daemon.address) as c:
        c.register_namespace(namespace_for(SPEC, "clash"), tokens_per_block=T + 1)
    s = Side(daemon.address, make_caches(307))
    assert s.sched.num_new_matched_tokens(Req("x1", prompt_tokens(40, start=699), cache_salt="clash"), 0) == (0, False)
    assert misses(s.sched) == {"miss_lookup_failed": 1}
    s.close()


def test_stream_mode_counts_every_request_it_cannot_serve(daemon) -> None:
    config = ConnectorConfig.from_extra({"address": daemon.address, "blocks_per_key": 2})
    stream = SchedulerSide(config, SPEC, StoreLink(daemon.address, timeout_s=5.0,
                                                   client_factory=lambda: Client(daemon.address, mode="stream")))
    for rid in ("s1", "s2"):
        assert stream.num_new_matched_tokens(Req(rid, prompt_tokens(40, start=710)), 0) == (0, False)
    assert stream.num_new_matched_tokens(Req("s3", [5] * 8), 0) == (0, False)     # 7 usable tokens: no key
    assert misses(stream) == {"miss_stream_mode": 2}


def test_a_failed_load_of_a_full_hit_is_load_failed(daemon) -> None:
    prompt = stored(daemon.address, 721)
    b = Side(daemon.address, make_caches(308))
    req = Req("l1", prompt)
    assert b.sched.num_new_matched_tokens(req, 0) == (96, True)    # every usable key: no miss yet
    with Client(daemon.address) as c:
        assert c.delete(namespace_for(SPEC), keys_of(prompt)[5:6]) == 1
    target = list(range(30, 55))
    b.sched.after_alloc(req, [target], 96)
    b.worker.start_loads(b.sched.build([]).loads)
    b.worker.drain()
    _, recv = b.worker.finished(set())
    errors = b.worker.load_errors()
    assert recv == {"l1"} and errors == set(target[:24])
    b.sched.on_worker_output(recv, errors)
    assert misses(b.sched) == {"miss_load_failed": 1}
    b.close()


# -- one cause per request, and they add up --------------------------------------------------------------------
class _NoExplain(Client):
    explain = None  # a client from before Client.explain


def test_misses_the_daemon_cannot_be_asked_about_are_unexplained(daemon) -> None:
    config = ConnectorConfig.from_extra({"address": daemon.address, "blocks_per_key": 2})
    old = SchedulerSide(config, SPEC, StoreLink(daemon.address, timeout_s=5.0,
                                                namespace_spec=lambda _n: registration(SPEC),
                                                client_factory=lambda: _NoExplain(daemon.address)))
    assert old.num_new_matched_tokens(Req("q1", prompt_tokens(40, start=732)), 0) == (0, False)
    assert misses(old) == {"miss_unexplained": 1}
    full = Side(daemon.address, make_caches(309))
    full.sched.misses.capacity = 0                                  # a full queue: counted at once, not queued
    assert full.sched.num_new_matched_tokens(Req("q2", prompt_tokens(40, start=733)), 0) == (0, False)
    assert full.sched.counters.totals.get("miss_unexplained") == 1
    assert misses(full.sched) == {"miss_unexplained": 1}
    full.close()


def test_the_explain_thread_ends_when_idle_and_starts_again(daemon) -> None:
    link = StoreLink(daemon.address, timeout_s=5.0, client_factory=lambda: _NoExplain(daemon.address))
    ex = MissExplainer(link, ConnectorCounters(), idle_s=0.05)
    ex.submit("i1", MissTarget(("ns",), b"k" * 16))
    assert ex.flush(10.0)
    wait_until(lambda: not ex.running, what="the idle explain thread to end")
    ex.submit("i2", MissTarget(("ns",), b"k" * 16))
    assert ex.flush(10.0)
    assert ex.counters.totals == {"miss_unexplained": 2}
    assert [r.req_id for r in ex.recent] == ["i1", "i2"]
    ex.close()
    assert not ex.running
    ex.submit("i3", MissTarget(("ns",), b"k" * 16))              # closed: counted at once
    assert ex.counters.totals == {"miss_unexplained": 3}


def test_one_cause_per_request_and_the_causes_add_up(daemon) -> None:
    """Five requests: a full hit (none), a fresh prompt, a deleted key, another salt, and a full hit whose load
    fails. A request's later lookups (after preemption) and a failed load after a short lookup count nothing
    more: 4 misses, one per request the store did not fully serve."""
    whole, cut, salted = stored(daemon.address, 744), stored(daemon.address, 755), stored(daemon.address, 766, "z")
    with Client(daemon.address) as c:
        assert c.delete(namespace_for(SPEC), keys_of(cut)[6:7]) == 1
    s = Side(daemon.address, make_caches(310))
    fresh = Req("fresh", prompt_tokens(40, start=777))
    assert s.sched.num_new_matched_tokens(Req("hit", whole), 0) == (96, True)
    assert s.sched.num_new_matched_tokens(fresh, 0) == (0, False)
    cut_req = Req("cut", cut)
    assert s.sched.num_new_matched_tokens(cut_req, 0) == (48, True)
    assert s.sched.num_new_matched_tokens(Req("salted", salted), 0) == (0, False)
    failing = Req("failing", list(whole))
    assert s.sched.num_new_matched_tokens(failing, 0) == (96, True)
    s.sched.build([ScheduledRequest("fresh", [list(range(5))], True, 40)])   # scheduled, then preempted:
    assert s.sched.num_new_matched_tokens(fresh, 0) == (0, False)             # a second lookup, same request
    with Client(daemon.address) as c:                 # both loads fail: "cut" counted its lookup's cause already
        assert c.delete(namespace_for(SPEC), keys_of(whole)[0:1] + keys_of(cut)[1:2]) == 2
    s.sched.after_alloc(failing, [list(range(25))], 96)
    s.sched.after_alloc(cut_req, [list(range(30, 55))], 48)
    s.worker.start_loads(s.sched.build([]).loads)
    s.worker.drain()
    _, recv = s.worker.finished(set())
    errors = s.worker.load_errors()
    assert recv == {"failing", "cut"} and errors == set(range(24)) | set(range(30, 42))
    s.sched.on_worker_output(recv, errors)
    counted = misses(s.sched)
    assert counted == {"miss_never_stored": 1, "miss_deleted": 1, "miss_other_namespace": 1, "miss_load_failed": 1}
    assert miss_summary(counted) == {"miss_causes": 4}
    assert sorted((r.req_id, r.cause) for r in s.sched.misses.recent) == [
        ("cut", "deleted"), ("failing", "load_failed"), ("fresh", "never_stored"), ("salted", "other_namespace")]
    s.close()
