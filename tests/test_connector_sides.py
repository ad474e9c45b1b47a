"""The connector's scheduler side + worker side against a real daemon, driven like vLLM drives them (requests
are small plain objects with the attribute names of vLLM's Request; tests/connector_helpers.py): round trips,
hits, failed and evicted loads, freed blocks, a store that is down, the peer tier, pipeline stages, stream mode.
The same classes under the real vLLM scheduler: tests/vllm_sched/."""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import replace

import pytest

from kvstore_connector.config import ConnectorConfig
from kvstore_connector.keys import KeyChain, chain_root
from kvstore_connector.link import StoreLink
from kvstore_connector.namespace import StageLayouts, namespace_for, registration
from kvstore_connector.scheduler import ScheduledRequest, SchedulerSide
from kvstore.client import Client
from kvstore.testing import free_port
from tests.connector_helpers import SPEC, T, Req, Side, block_bytes_of, make_caches, prompt_tokens
from tests.control_paths import per_path_daemon
from tests.peer_helpers import Cluster, needs_etcd

pytestmark = pytest.mark.usefixtures("control_path")  # every test over the fast path and over gRPC
daemon = per_path_daemon()


def test_save_then_load_into_other_blocks_round_trips_exact_bytes(daemon) -> None:
    a = Side(daemon.address, make_caches(10))
    req = Req("r1", prompt_tokens(100))
    assert a.sched.num_new_matched_tokens(req, 0) == (0, False)
    a.prefill(req, list(range(25)))                          # 100 tokens -> 25 vLLM blocks, 12 full keys
    ns = namespace_for(SPEC)
    with Client(daemon.address) as c:
        keys = KeyChain(T, 0, chain_root(0)).extend(req.prompt_token_ids)
        assert len(keys) == 12
        stored = c.get_many(ns, keys)
        assert stored == [block_bytes_of(a.caches, 2 * k) + block_bytes_of(a.caches, 2 * k + 1) for k in range(12)]
    assert a.worker.counters.totals["saved_blocks"] == 12
    assert a.worker.counters.totals["saved_bytes"] == 12 * 2 * SPEC.block_bytes

    # A second "vLLM" with an empty cache: the same prompt hits 96 tokens (12 keys; 100 - 1 usable).
    b = Side(daemon.address, make_caches(11))
    again = Req("r2", list(req.prompt_token_ids))
    assert b.sched.num_new_matched_tokens(again, 0) == (96, True)
    target = list(range(30, 55))
    b.sched.after_alloc(again, [target], 96)
    b.prefill(again, target)
    sent, recv = b.worker.finished(set())
    assert (sent, recv) == (set(), {"r2"}) and b.worker.load_errors() == set()
    assert [block_bytes_of(b.caches, x) for x in target[:24]] == [block_bytes_of(a.caches, x) for x in range(24)]
    assert b.worker.counters.totals["loaded_blocks"] == 12
    assert b.worker.counters.totals.get("saved_blocks", 0) == 0  # nothing new: the tail is a partial key
    a.close(), b.close()


def test_a_ram_hit_loads_in_the_step_that_schedules_it(daemon) -> None:
    """load_mode "auto" (the default), every hit in RAM: the scheduler offers a synchronous load (False), the
    request's job is marked sync, and start_loads returns only when the exact bytes are in vLLM's blocks
    (no drain); nothing is reported received, since vLLM is not waiting for it."""
    a = Side(daemon.address, make_caches(12))
    req = Req("s1", prompt_tokens(100, start=4))
    a.prefill(req, list(range(25)))
    b = Side(daemon.address, make_caches(13), load_mode="auto")
    again = Req("s2", list(req.prompt_token_ids))
    assert b.sched.num_new_matched_tokens(again, 0) == (96, False)
    target = list(range(30, 55))
    b.sched.after_alloc(again, [target], 96)
    plan = b.sched.build([ScheduledRequest("s2", [target], True, 4)])   # scheduled in the same step
    assert [j.sync for j in plan.loads] == [True]
    b.worker.start_loads(plan.loads)
    assert [block_bytes_of(b.caches, x) for x in target[:24]] == [block_bytes_of(a.caches, x) for x in range(24)]
    assert b.worker.finished(set()) == (set(), set()) and b.worker.load_errors() == set()
    assert (b.sched.counters.totals["load_requests"], b.sched.counters.totals["load_sync_requests"]) == (1, 1)
    a.close(), b.close()


def test_a_failed_sync_load_fails_its_blocks_and_they_are_saved_again(daemon) -> None:
    """load_mode "sync": a key evicted between the lookup and the load fails the whole job's blocks in the
    step's load errors (vLLM recomputes them), and the stored count rolls back even though the request was
    scheduled (built) in the step of its load, so the recomputed blocks are saved again."""
    a = Side(daemon.address, make_caches(14))
    req = Req("f1", prompt_tokens(100, start=8))
    a.prefill(req, list(range(25)))
    keys = KeyChain(T, 0, chain_root(0)).extend(req.prompt_token_ids)
    b = Side(daemon.address, make_caches(15), load_mode="sync")
    again = Req("f2", list(req.prompt_token_ids))
    assert b.sched.num_new_matched_tokens(again, 0) == (96, False)
    with Client(daemon.address) as c:
        assert c.delete(namespace_for(SPEC), keys[5:6]) == 1
    target = list(range(30, 55))
    b.sched.after_alloc(again, [target], 96)
    plan = b.sched.build([ScheduledRequest("f2", [target], True, 4)])
    b.worker.start_loads(plan.loads)
    errors = b.worker.load_errors()
    assert errors == set(target[:24]) and b.worker.finished(set()) == (set(), set())
    b.sched.build([ScheduledRequest("f2", [[]], False, 1)])    # async scheduling: the next step is built first
    b.sched.on_worker_output(set(), errors)                  # then the load's step reports its failures
    assert b.sched.counters.totals["load_rollback_keys"] == 12
    again.num_computed_tokens = 0                            # vLLM recomputes the prompt
    (job,) = b.sched.build([ScheduledRequest("f2", [[]], False, 100)]).saves
    assert job.keys == keys and job.block_ids == [target[:24]]
    a.close(), b.close()


def test_partial_prefix_and_local_prefix_cache(daemon) -> None:
    a = Side(daemon.address, make_caches(20))
    a.prefill(Req("r1", prompt_tokens(64, start=1)), list(range(16)))  # 8 keys (prompts differ per test: one daemon)
    b = Side(daemon.address, make_caches(21))
    diverge = prompt_tokens(40, start=1) + prompt_tokens(40, start=500)           # first 40 tokens shared -> 5 keys
    req = Req("r2", diverge)
    assert b.sched.num_new_matched_tokens(req, 0) == (40, True)
    # vLLM's own prefix cache already has 12 tokens (3 blocks): the store adds 28, starting inside key 1
    req2 = Req("r3", list(diverge))
    assert b.sched.num_new_matched_tokens(req2, 12) == (28, True)
    served = {k: b.sched.counters.totals.get(f"served_tokens_{k}", 0) for k in ("vllm", "ram", "disk", "peer")}
    assert served == {"vllm": 12, "ram": 40 + 32, "disk": 0, "peer": 0}   # key 0 is vLLM's in the second lookup
    target = list(range(40, 60))
    b.sched.after_alloc(req2, [target], 28)
    plan = b.sched.build([])
    (job,) = plan.loads
    assert job.block_ids == [[-1, target[3]] + target[4:10]]   # block 2 of key 1 is vLLM's: left untouched
    before = block_bytes_of(b.caches, target[2])
    b.worker.start_loads(plan.loads)
    b.worker.drain()
    assert b.worker.finished(set())[1] == {"r3"} and b.worker.load_errors() == set()
    assert block_bytes_of(b.caches, target[2]) == before
    assert [block_bytes_of(b.caches, x) for x in target[3:10]] == [block_bytes_of(a.caches, x) for x in range(3, 10)]
    a.close(), b.close()


def test_evicted_between_lookup_and_load_fails_those_blocks_for_recompute(daemon) -> None:
    a = Side(daemon.address, make_caches(30))
    a.prefill(Req("r1", prompt_tokens(33, start=2)), list(range(9)))  # 4 keys
    req = Req("r2", prompt_tokens(33, start=2))
    assert a.sched.num_new_matched_tokens(req, 0) == (32, True)
    with Client(daemon.address) as c:
        keys = KeyChain(T, 0, chain_root(0)).extend(req.prompt_token_ids)
        assert c.delete(namespace_for(SPEC), keys[2:3]) == 1
    a.sched.after_alloc(req, [list(range(20, 29))], 32)
    a.worker.start_loads(a.sched.build([]).loads)
    a.worker.drain()
    assert a.worker.finished(set()) == (set(), {"r2"})
    assert a.worker.load_errors() == set(range(20, 28))
    assert a.worker.counters.totals["load_failed_blocks"] == 8
    a.close()


def test_finished_request_frees_its_blocks_at_once(daemon) -> None:
    """The gather has read the blocks when wait_for_save returns: vLLM need not hold them for the commit. So
    request_finished lets vLLM free them at once, and a block vLLM reuses (overwrites) right away does not
    change what is stored; the request's state is gone, so it is never saved from again."""
    a = Side(daemon.address, make_caches(40), save="all")
    req = Req("r1", prompt_tokens(20, start=3))
    a.sched.track(req)
    plan = a.sched.build([ScheduledRequest("r1", [list(range(5))], True, 20)])   # 20 tokens -> 2 keys
    before = [block_bytes_of(a.caches, 2 * k) + block_bytes_of(a.caches, 2 * k + 1) for k in range(2)]
    a.worker.save(plan.saves)                                # gathers now; the Commit may still be pending
    keep_blocks = a.sched.request_finished(req)
    for t in a.caches.values():                              # vLLM hands blocks 0..4 to another request
        t[:, 0:5] = -7.0
    a.worker.drain()
    with Client(daemon.address) as c:
        keys = KeyChain(T, 0, chain_root(0)).extend(req.prompt_token_ids)
        assert c.get_many(namespace_for(SPEC), keys) == before
    assert keep_blocks is False and a.worker.finished({"r1"}) == (set(), set())  # nothing for vLLM to wait for
    assert a.sched.num_tracked == 0
    req.output = [1, 2, 3, 4]                                # a late step for the finished id saves nothing
    assert a.sched.build([ScheduledRequest("r1", [[5]], False, 4)]).saves == []
    a.close()


def test_generated_tokens_are_saved_only_with_save_all(daemon) -> None:
    for policy, expect in (("prompt", 1), ("all", 2)):
        s = Side(daemon.address, make_caches(50), save=policy)
        req = Req(f"gen-{policy}", prompt_tokens(12, start=300 + len(policy)))
        s.prefill(req, [0, 1, 2, 3])                         # 12 tokens: 1 full key
        req.output = [5, 6, 7, 8]                            # 4 generated tokens -> 16 tokens, 2 keys
        s.sched.build([ScheduledRequest(req.request_id, None, False, 0)])
        req.num_computed_tokens = 16
        plan = s.sched.build([ScheduledRequest(req.request_id, [[4]], False, 0)])
        s.worker.save(plan.saves)
        s.worker.drain()
        assert s.worker.counters.totals["saved_blocks"] == expect, policy
        s.close()


def test_store_down_costs_hits_not_requests(tmp_path) -> None:
    dead = f"127.0.0.1:{free_port()}"
    s = Side(dead, make_caches(60), lookup_timeout_s=0.2)
    req = Req("r1", prompt_tokens(40))
    assert s.sched.num_new_matched_tokens(req, 0) == (0, False)
    s.sched.after_alloc(req, [list(range(10))], 0)
    plan = s.sched.build([ScheduledRequest("r1", [list(range(10))], True, 40)])
    assert len(plan.saves) == 1
    s.worker.save(plan.saves)                                # no exception, counted
    assert s.worker.counters.totals["save_failures"] == 1
    fake = Req("r2", prompt_tokens(40))
    s.sched.after_alloc(fake, [list(range(10, 20))], 32)       # a load planned while the store was up
    s.worker.start_loads(s.sched.build([]).loads)
    s.worker.drain()
    assert s.worker.finished(set()) == (set(), {"r2"})
    assert s.worker.load_errors() == set(range(10, 18))
    s.close()


def test_requests_longer_than_max_batch_keys_save_and_load_in_parts(make_daemon) -> None:
    d = make_daemon(arena_bytes="64MiB", max_block_bytes="4MiB", max_batch_keys=5)
    a = Side(d.address, make_caches(70))
    req = Req("long", prompt_tokens(100, start=4))
    a.prefill(req, list(range(25)))                          # 12 keys -> Reserves of 5, 5 and 2 keys
    assert a.worker.counters.totals["saved_blocks"] == 12
    assert a.worker.counters.totals.get("save_failures", 0) == 0
    b = Side(d.address, make_caches(71))
    again = Req("long2", list(req.prompt_token_ids))
    assert b.sched.num_new_matched_tokens(again, 0) == (96, True)   # the scheduler's prefix lookup splits too
    target = list(range(30, 55))
    b.sched.after_alloc(again, [target], 96)
    b.worker.start_loads(b.sched.build([]).loads)            # one LoadJob of 12 keys -> Lookups of 5, 5, 2
    b.worker.drain()
    assert b.worker.finished(set()) == (set(), {"long2"}) and b.worker.load_errors() == set()
    assert b.worker.counters.totals["loaded_blocks"] == 12
    assert [block_bytes_of(b.caches, x) for x in target[:24]] == [block_bytes_of(a.caches, x) for x in range(24)]
    a.close(), b.close()


@needs_etcd
def test_a_prompt_saved_on_one_node_loads_on_another_through_the_peer_tier() -> None:
    """Two daemons joined through etcd: vLLM on node a saves a prompt (its blocks are pushed to their owners);
    a second vLLM on node b finds it with one probe per peer (the scheduler does not wait for bytes), and its
    load joins the background fetch and scatters exactly the bytes a saved."""
    with ExitStack() as stack:
        cluster = Cluster(stack, names=("a", "b"), timeout_s=5.0)
        a = Side(cluster.nodes["a"].address, make_caches(40))
        req = Req("c1", prompt_tokens(100, start=3))
        a.prefill(req, list(range(25)))                      # 12 full keys saved on a
        cluster.wait_pushes("a")
        ns = namespace_for(SPEC)
        keys = KeyChain(T, 0, chain_root(0)).extend(req.prompt_token_ids)
        on_a_only = sum(cluster.owner(ns, k) == "a" for k in keys)   # b's owned keys were pushed to b
        before = cluster.counters("b")
        b = Side(cluster.nodes["b"].address, make_caches(41))
        again = Req("c2", list(req.prompt_token_ids))
        assert b.sched.num_new_matched_tokens(again, 0) == (96, True)
        # b's own keys (pushed to it) come from RAM; a's from the peer, or from RAM when the probe's background
        # fetch lands before its reply is built (a race, on a loaded machine): every hit token has one source
        served = {k: b.sched.counters.totals.get(f"served_tokens_{k}", 0) for k in ("vllm", "ram", "peer")}
        assert served["vllm"] == 0 and served["ram"] + served["peer"] == 96 and served["ram"] >= T * (12 - on_a_only)
        after = cluster.counters("b")
        assert after["probe_calls"] - before["probe_calls"] == (1 if on_a_only else 0)
        assert after["prefetch_keys"] - before["prefetch_keys"] == on_a_only
        target = list(range(30, 55))
        b.sched.after_alloc(again, [target], 96)
        b.prefill(again, target)
        assert b.worker.finished(set())[1] == {"c2"} and b.worker.load_errors() == set()
        assert [block_bytes_of(b.caches, x) for x in target[:24]] == [block_bytes_of(a.caches, x) for x in range(24)]
        final = cluster.counters("b")
        assert final["fetched_blocks"] - before["fetched_blocks"] == on_a_only   # fetched once, by the prefetch
        assert final["fetch_calls"] - before["fetch_calls"] == (1 if on_a_only else 0)
        a.close(), b.close()


# -- pipeline stages (issue 16 item 3) ------------------------------------------------------------------------
def test_lookup_offers_the_prefix_every_pipeline_stage_holds(daemon) -> None:
    """Stages of 2 and 1 layers (an uneven split): the scheduler asks each stage's namespace and offers the
    shortest prefix; stage 1 lacks key 3 -> 3 keys (24 tokens), whatever stage 0 holds. Every hit is in RAM,
    so the default load_mode ("auto") offers each as a synchronous load (False)."""
    s0, s1 = replace(SPEC, num_layers=2, first_layer=0), replace(SPEC, num_layers=1, first_layer=2)
    stages = StageLayouts([s0, s1])
    config = ConnectorConfig.from_extra({"address": daemon.address, "blocks_per_key": 2})
    sched = SchedulerSide(config, s0, StoreLink(daemon.address, timeout_s=5.0, namespace_spec=stages.registration),
                          stages=stages)
    prompt = prompt_tokens(60, start=900)                          # 59 usable tokens -> 7 keys
    keys = KeyChain(T, 0, chain_root(0)).extend(prompt)
    n0, n1 = stages.names()
    with Client(daemon.address) as c:
        for name, spec in ((n0, s0), (n1, s1)):
            c.register_namespace(name, **registration(spec))
        c.put_many(n0, keys[:7], [bytes(2 * s0.block_bytes)] * 7)
        c.put_many(n1, keys[:3] + keys[4:7], [bytes(2 * s1.block_bytes)] * 6)
        assert sched.num_new_matched_tokens(Req("p1", prompt), 0) == (24, False)
        assert sched.num_new_matched_tokens(Req("p2", prompt), 8) == (16, False)   # 8 in vLLM's own cache
        c.put(n1, keys[3], bytes(2 * s1.block_bytes))
        assert sched.num_new_matched_tokens(Req("p3", prompt), 0) == (56, False)
        c.delete(n0, keys[0:1])
        assert sched.num_new_matched_tokens(Req("p4", prompt), 0) == (0, False)
        digests = {n.name: n.layout_digest for n in c.stats().namespaces if n.name in (n0, n1)}
    assert digests == {n0: s0.digest(), n1: s1.digest()}
    assert sched.counters.totals["hit_tokens"] == 24 + 24 + 56


# -- every async load gets a job (issue 16 item 7) ------------------------------------------------------------
def test_a_load_with_fewer_blocks_than_keys_still_gets_a_job(daemon, caplog) -> None:
    """vLLM puts the request in WAITING_FOR_REMOTE_KVS before update_state_after_alloc; only the worker's
    report takes it out. A block table shorter than the hit (vLLM never sends one) used to drop the job and
    strand the request; now the job covers what fits and the request is reported received."""
    a = Side(daemon.address, make_caches(100))
    a.prefill(Req("r1", prompt_tokens(100, start=7)), list(range(25)))
    b = Side(daemon.address, make_caches(101))
    req = Req("r2", prompt_tokens(100, start=7))
    assert b.sched.num_new_matched_tokens(req, 0) == (96, True)
    with caplog.at_level(logging.ERROR, logger="kvstore_connector.scheduler"):
        b.sched.after_alloc(req, [list(range(30, 50))], 96)    # 20 blocks for 24
    (job,) = b.sched.build([]).loads
    assert len(job.keys) == 12 and job.block_ids == [list(range(30, 50)) + [-1] * 4]
    assert any("beyond the 12 keys looked up or the 20 blocks allocated" in r.getMessage() for r in caplog.records)
    b.worker.start_loads([job])
    b.worker.drain()
    assert b.worker.finished(set())[1] == {"r2"}
    a.close(), b.close()


# -- blocks that failed to load are saved again (issue 16 item 6) ---------------------------------------------
def test_blocks_that_failed_to_load_are_saved_again(daemon) -> None:
    a = Side(daemon.address, make_caches(90))
    req = Req("r1", prompt_tokens(100, start=6))
    a.prefill(req, list(range(25)))                          # 12 keys
    keys = KeyChain(T, 0, chain_root(0)).extend(req.prompt_token_ids)
    b = Side(daemon.address, make_caches(91))
    again = Req("r2", list(req.prompt_token_ids))
    assert b.sched.num_new_matched_tokens(again, 0) == (96, True)
    with Client(daemon.address) as c:
        assert c.delete(namespace_for(SPEC), keys[5:6]) == 1   # evicted between lookup and load
    target = list(range(30, 55))
    b.sched.after_alloc(again, [target], 96)
    b.worker.start_loads(b.sched.build([]).loads)
    b.worker.drain()
    recv, errors = b.worker.finished(set())[1], b.worker.load_errors()
    assert recv == {"r2"} and errors == set(target[:24])     # the whole job fails
    b.sched.on_worker_output(recv, errors)                   # vLLM's update_connector_output
    assert b.sched.counters.totals["load_rollback_keys"] == 12
    plan = b.sched.build([ScheduledRequest("r2", [target], True, 100)])   # vLLM recomputed the prompt
    (job,) = plan.saves
    assert job.keys == keys and job.block_ids == [target[:24]]
    b.worker.save(plan.saves)
    b.worker.drain()
    assert (b.worker.counters.totals["saved_blocks"], b.worker.counters.totals["save_skipped_blocks"]) == (1, 11)
    with Client(daemon.address) as c:
        assert c.get(namespace_for(SPEC), keys[5]) == block_bytes_of(b.caches, target[10]) + block_bytes_of(b.caches,
                                                                                                         target[11])

    # A failed block inside the job rolls back to the stored block that holds it (blocks 7 -> key 3); the
    # failure of another request's block changes nothing.
    c3 = Req("r3", prompt_tokens(100, start=6))
    assert b.sched.num_new_matched_tokens(c3, 0) == (96, True)
    b.sched.after_alloc(c3, [list(range(25))], 96)
    b.sched.build([])
    b.sched.on_worker_output(set(), {60})
    b.sched.on_worker_output({"r3"}, {7})
    (job,) = b.sched.build([ScheduledRequest("r3", [list(range(25))], True, 100)]).saves
    assert job.keys == keys[3:] and job.block_ids == [list(range(6, 24))]
    a.close(), b.close()


# -- stream mode (issue 16 item 4) ----------------------------------------------------------------------------
def test_no_hits_when_the_scheduler_reaches_the_store_only_by_streaming(daemon, caplog) -> None:
    """The workers load only through the arena: a hit offered by a process that cannot map it would fail."""
    a = Side(daemon.address, make_caches(80))
    a.prefill(Req("r1", prompt_tokens(100, start=5)), list(range(25)))
    config = ConnectorConfig.from_extra({"address": daemon.address, "blocks_per_key": 2})
    stream = SchedulerSide(config, SPEC, StoreLink(daemon.address, timeout_s=5.0,
                                                   namespace_spec=lambda _n: registration(SPEC),
                                                   client_factory=lambda: Client(daemon.address, mode="stream")))
    with caplog.at_level(logging.ERROR, logger="kvstore_connector.scheduler"):
        assert stream.num_new_matched_tokens(Req("r2", prompt_tokens(100, start=5)), 0) == (0, False)
        assert stream.num_new_matched_tokens(Req("r3", prompt_tokens(100, start=5)), 0) == (0, False)
    assert stream.link.client.mode == "stream"
    assert stream.counters.totals == {"lookup_skipped_stream": 2, "miss_stream_mode": 2}  # one miss a request
    (msg,) = [r.getMessage() for r in caplog.records if r.name == "kvstore_connector.scheduler"]
    assert "arena cannot be mapped by this process" in msg and "offering no hits" in msg
    assert Side(daemon.address, make_caches(81)).sched.num_new_matched_tokens(Req("r4", prompt_tokens(100, start=5)),
                                                                            0) == (96, True)   # arena mode
    a.close()
