"""Claims through the connector's two sides (kvstore_connector/claims.py), real daemons, exact bytes.

Two servers get one new prompt at once: the first one's lookup misses and claims its keys; the second one's
lookup misses too, finds them pending and loads them asynchronously, its worker waiting for the first one's save,
with the bytes that server computed (across two daemons joined by etcd, and between two vLLM instances on one
node). A claimant that saves only part of them before its claim runs out: the waiter loads that part and reports
the rest failed (vLLM computes it, the scheduler saves it again). claim_ms 0: no claim, both compute."""

from __future__ import annotations

import threading
from contextlib import ExitStack

import pytest

from kvstore.client import Client
from kvstore.testing import wait_until
from kvstore_connector.keys import KeyChain, chain_root
from kvstore_connector.namespace import namespace_for
from tests.connector_helpers import SPEC, T, Req, Side, block_bytes_of, make_caches, prompt_tokens
from tests.peer_helpers import Cluster, needs_etcd

pytestmark = pytest.mark.usefixtures("control_path")  # every test over the fast path and over gRPC

TARGET = list(range(30, 55))  # the second server's blocks for the 12 keys (24 blocks) and the last token


def _waiting_load(b: Side, req: Req) -> None:
    """b's scheduler offers the whole prompt as pending, and its worker starts waiting for it."""
    assert b.sched.num_new_matched_tokens(req, 0) == (96, True)       # 12 keys of 8 tokens, loaded async
    assert b.sched.counters.totals["claim_pending_keys"] == 12
    b.sched.after_alloc(req, [TARGET], 96)
    plan = b.sched.build([])                     # waiting for remote KVs: not scheduled in this step
    assert [(len(j.keys), j.wait_s) for j in plan.loads] == [(12, b.config.claim_ms / 1000)]
    b.worker.start_loads(plan.loads)             # asynchronous: the loader thread waits


def _claimed_then_awaited(a: Side, b: Side, start: int) -> Req:
    """a's lookup of a new prompt misses and claims its 12 keys; b's of the same prompt waits for them. a's
    request, still to be computed."""
    first = Req("r1", prompt_tokens(100, start=start))
    assert a.sched.num_new_matched_tokens(first, 0) == (0, False)
    _waiting_load(b, Req("r2", list(first.prompt_token_ids)))
    return first


def _received(b: Side, rid: str) -> None:
    got: set[str] = set()
    wait_until(lambda: got.update(b.worker.finished(set())[1]) or rid in got, 15, what=f"{rid} received")


@needs_etcd
def test_a_second_server_waits_for_the_first_ones_save_and_loads_its_exact_bytes() -> None:
    with ExitStack() as stack:
        cluster = Cluster(stack, names=("a", "b"), timeout_s=5.0)
        a = Side(cluster.nodes["a"].address, make_caches(700), claim_ms=5000)
        b = Side(cluster.nodes["b"].address, make_caches(701), claim_ms=5000)
        first = _claimed_then_awaited(a, b, 702)
        assert a.sched.counters.totals["claimed_keys"] == 12
        a.prefill(first, list(range(25)))        # a computes and saves; b's worker is waiting meanwhile
        _received(b, "r2")
        assert b.worker.load_errors() == set()
        assert [block_bytes_of(b.caches, x) for x in TARGET[:24]] == [block_bytes_of(a.caches, x) for x in range(24)]
        t = b.worker.counters.totals
        assert (t["claim_waits"], t["claim_waits_served"], t.get("claim_wait_missed_keys", 0)) == (1, 1, 0)
        assert t["loaded_blocks"] == 12 and 0 < t["claim_wait_seconds"] < 5
        a.close(), b.close()


def test_two_vllm_instances_on_one_node_share_a_prefix_being_computed(make_daemon) -> None:
    d = make_daemon(arena_bytes="8MiB", max_block_bytes="1MiB")
    a, b = Side(d.address, make_caches(710), claim_ms=5000), Side(d.address, make_caches(711), claim_ms=5000)
    first = _claimed_then_awaited(a, b, 712)
    saver = threading.Timer(0.2, a.prefill, (first, list(range(25))))  # the save lands while b waits
    saver.start()
    _received(b, "r2")
    saver.join()
    assert b.worker.load_errors() == set()
    assert [block_bytes_of(b.caches, x) for x in TARGET[:24]] == [block_bytes_of(a.caches, x) for x in range(24)]
    assert b.worker.counters.totals["claim_wait_seconds"] >= 0.15
    a.close(), b.close()


def test_a_claim_that_runs_out_half_saved_loads_what_came_and_fails_the_rest(make_daemon) -> None:
    d = make_daemon(arena_bytes="8MiB", max_block_bytes="1MiB")
    a, b = Side(d.address, make_caches(720), claim_ms=400), Side(d.address, make_caches(721), claim_ms=400)
    first = _claimed_then_awaited(a, b, 722)
    # a is preempted after its first 40 tokens: only the first five keys are saved (the same chain: same keys)
    part = Req("r1-part", list(first.prompt_token_ids[:41]))
    a.prefill(part, list(range(11)))
    _received(b, "r2")
    # five keys loaded with a's bytes; the other seven keys' fourteen blocks failed: vLLM computes them
    assert [block_bytes_of(b.caches, x) for x in TARGET[:10]] == [block_bytes_of(a.caches, x) for x in range(10)]
    errors = b.worker.load_errors()              # taken: vLLM asks once
    assert errors == set(TARGET[10:24])
    t = b.worker.counters.totals
    assert (t["claim_waits"], t.get("claim_waits_served", 0), t["claim_wait_missed_keys"]) == (1, 0, 7)
    assert 0.35 < t["claim_wait_seconds"] < 5
    # the scheduler saves the seven again once vLLM has computed them
    b.sched.on_worker_output({"r2"}, errors)
    assert b.sched.counters.totals["load_rollback_keys"] == 7
    keys = KeyChain(T, 0, chain_root(0)).extend(first.prompt_token_ids)
    with Client(d.address) as c:
        assert c.exists(namespace_for(SPEC), keys[:12]) == [True] * 5 + [False] * 7
    a.close(), b.close()


def test_without_claims_the_second_server_computes(make_daemon) -> None:
    d = make_daemon(arena_bytes="8MiB", max_block_bytes="1MiB")
    a, b = Side(d.address, make_caches(730), claim_ms=0), Side(d.address, make_caches(731), claim_ms=0)
    first = Req("r1", prompt_tokens(100, start=732))
    assert a.sched.num_new_matched_tokens(first, 0) == (0, False)
    assert b.sched.num_new_matched_tokens(Req("r2", list(first.prompt_token_ids)), 0) == (0, False)
    assert "claimed_keys" not in a.sched.counters.totals and "claim_pending_keys" not in b.sched.counters.totals
    with Client(d.address) as c:
        assert c.stats().counters["claim_claimed_keys"] == 0
    a.close(), b.close()
