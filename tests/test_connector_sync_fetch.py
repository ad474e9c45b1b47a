"""load_mode "auto" with blocks off RAM (sync_fetch_bytes): a hit whose blocks on this node's disk (past vLLM's own
cache) fit the budget loads in the step that schedules it, the worker reading them while the step waits, with
exact bytes; one past the budget, or with a budget of 0, loads asynchronously; blocks vLLM already holds do not
count; a tail on disk is one more block to read; blocks at a peer load in the step the same way. Real daemons
(with a disk tier; two joined through etcd), both control paths. The same under the real vLLM scheduler:
tests/vllm_sched/test_vllm_scheduler.py."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

import pytest

from kvstore_connector.config import ConnectorConfig
from kvstore_connector.keys import KeyChain, chain_root, tail_keys
from kvstore_connector.load_policy import LoadPolicy
from kvstore_connector.namespace import StageLayouts, namespace_for, registration
from kvstore_connector.scheduler import ScheduledRequest
from kvstore.client import Client
from kvstore.testing import DaemonProcess, wait_until
from kvstore.vocab import Tier
from tests.connector_helpers import SPEC, T, Req, Side, block_bytes_of, make_caches, prompt_tokens
from tests.peer_helpers import Cluster, needs_etcd
from tests.test_connector_tails import S1, T1, _finish, _run

pytestmark = pytest.mark.usefixtures("control_path")  # every test over the fast path and over gRPC

KEY_BYTES = SPEC.block_bytes * SPEC.blocks_per_key   # one stored block, the only shard


@pytest.mark.parametrize("mode,groups,fetch,want", [
    ("auto", 1, 0, True), ("auto", 1, 3, True), ("auto", 1, 4, False),   # a budget of 3 keys' bytes
    ("sync", 1, 100, True), ("async", 1, 0, False),
    ("auto", 2, 0, False), ("sync", 2, 0, False),                          # several KV cache groups: never
])
def test_the_load_policy(mode: str, groups: int, fetch: int, want: bool) -> None:
    config = ConnectorConfig.from_extra({"load_mode": mode, "sync_fetch_bytes": 3 * KEY_BYTES})
    policy = LoadPolicy(config, StageLayouts([SPEC]), groups)
    assert policy.sync(fetch) is want
    ram, disk, peer = int(Tier.RAM), int(Tier.DISK), int(Tier.PEER)
    assert [policy.fetch_keys([disk, ram, peer, disk], local) for local in (0, T, T + 4, 2 * T, 4 * T)] == [
        3, 2, 2, 2, 0]                                   # a key partly in vLLM's cache (T + 4) still counts


def _disk_daemon(make_daemon: Callable[..., DaemonProcess]) -> DaemonProcess:
    # disk_write = commit: a put's blocks are on disk soon after it (the tests put blocks there that way)
    return make_daemon(arena_bytes="8MiB", max_block_bytes="1MiB", disk_bytes="16MiB", disk_segment_bytes="4MiB",
                       disk_sync="none", disk_write="commit")


def _on_disk_only(c: Client, ns: str, keys: list[bytes]) -> None:
    """Written behind, then demoted: ``keys`` are on disk and no longer in RAM (a lookup's promotion of them
    is waited out first, so it cannot land after the demotion)."""
    tier = lambda: [i.tier if i is not None else None for i in c.describe(ns, keys)]  # noqa: E731
    wait_until(lambda: tier() == ["ram+disk"] * len(keys), what="blocks written behind or promoted back")
    c.hint(ns, keys, "demote")
    wait_until(lambda: tier() == ["disk"] * len(keys), what="blocks demoted")


@pytest.mark.parametrize("on_disk,budget,local,want_async,disk_tokens", [
    ((10, 12), 2 * KEY_BYTES, 0, False, 2 * T),   # two blocks to read, two blocks' budget: in the step
    ((10, 12), KEY_BYTES, 0, True, 2 * T),        # one block's budget: asynchronous
    ((10, 12), 0, 0, True, 2 * T),                # 0: only hits all in RAM load in the step
    ((0, 2), 0, 2 * T, False, 0),                 # the disk blocks are vLLM's own already: nothing to read
    ((0, 2), 0, T, True, T),                      # one of them is not
])
def test_the_budget_decides_which_hits_with_blocks_on_disk_load_in_the_step(make_daemon, on_disk, budget, local,
                                                                             want_async, disk_tokens) -> None:
    d = _disk_daemon(make_daemon)
    a = Side(d.address, make_caches(600))
    req = Req("src", prompt_tokens(100, start=601))
    a.prefill(req, list(range(25)))                          # 12 keys of 8 tokens
    keys = KeyChain(T, 0, chain_root(0)).extend(req.prompt_token_ids)
    with Client(d.address) as c:
        _on_disk_only(c, namespace_for(SPEC), keys[on_disk[0]:on_disk[1]])
    b = Side(d.address, make_caches(602), load_mode="auto", sync_fetch_bytes=budget)
    assert b.sched.num_new_matched_tokens(Req("b", list(req.prompt_token_ids)), local) == (96 - local, want_async)
    served = {k: b.sched.counters.totals.get(f"served_tokens_{k}", 0) for k in ("vllm", "ram", "disk")}
    assert served == {"vllm": local, "ram": 96 - local - disk_tokens, "disk": disk_tokens}
    a.close(), b.close()


def test_a_sync_load_reads_its_disk_blocks_while_the_step_waits(make_daemon) -> None:
    """The request is scheduled in the step that admits it: start_loads returns with the exact bytes of every
    block in vLLM's, the two read from disk included; nothing is reported received (vLLM does not wait)."""
    d = _disk_daemon(make_daemon)
    a = Side(d.address, make_caches(610))
    req = Req("src", prompt_tokens(100, start=611))
    a.prefill(req, list(range(25)))
    keys = KeyChain(T, 0, chain_root(0)).extend(req.prompt_token_ids)
    with Client(d.address) as c:
        _on_disk_only(c, namespace_for(SPEC), keys[10:12])
    b = Side(d.address, make_caches(612), load_mode="auto")         # the default budget, 16 MiB
    again = Req("b", list(req.prompt_token_ids))
    assert b.sched.num_new_matched_tokens(again, 0) == (96, False)
    target = list(range(30, 55))
    b.sched.after_alloc(again, [target], 96)
    plan = b.sched.build([ScheduledRequest("b", [target], True, 4)])
    assert [j.sync for j in plan.loads] == [True]
    b.worker.start_loads(plan.loads)
    assert [block_bytes_of(b.caches, x) for x in target[:24]] == [block_bytes_of(a.caches, x) for x in range(24)]
    assert b.worker.finished(set()) == (set(), set()) and b.worker.load_errors() == set()
    totals = b.sched.counters.totals
    assert (totals["load_sync_requests"], totals["load_sync_fetch_requests"], totals["served_tokens_disk"]) == (
        1, 1, 2 * T)
    a.close(), b.close()


def test_a_tail_on_disk_is_offered_when_it_fits(make_daemon) -> None:
    """An agent's next turn whose previous turn's partial last block went to disk: the hit runs to the tail's end;
    within the budget the load copies its exact bytes in the step, with a budget of 0 it loads asynchronously."""
    d = _disk_daemon(make_daemon)
    a = Side(d.address, make_caches(620), S1, save="all", load_mode="auto")
    first = Req("t1", prompt_tokens(10, start=621), output=[901])   # 2 full keys + a 2-token tail
    _run(a, first, [0, 1, 2])
    assert _finish(a, first, [0, 1, 2])[0] is True
    tail_key = tail_keys(KeyChain(T1, 0, chain_root(0)).extend(first.prompt_token_ids)[1],
                         first.prompt_token_ids[8:], 0)[-1]
    with Client(d.address) as c:
        _on_disk_only(c, namespace_for(S1), [tail_key])
    turn = first.all_token_ids + prompt_tokens(5, start=700)
    none = Side(d.address, make_caches(621), S1, save="all", load_mode="auto", sync_fetch_bytes=0)
    assert none.sched.num_new_matched_tokens(Req("t2-none", list(turn)), 0) == (10, True)
    assert none.sched.counters.totals["tail_hit_tokens"] == 2
    with Client(d.address) as c:                 # that lookup's probe of the tail started promoting it
        _on_disk_only(c, namespace_for(S1), [tail_key])
    b = Side(d.address, make_caches(622), S1, save="all", load_mode="auto")
    req = Req("t2", list(turn))
    assert b.sched.num_new_matched_tokens(req, 0) == (10, False)
    target = [20, 21, 22, 23]
    b.sched.after_alloc(req, [target], 10)
    req.num_computed_tokens = 10
    plan = b.sched.build([ScheduledRequest("t2", [target], True, 6)])
    assert [(j.keys[-1], j.sync) for j in plan.loads] == [(tail_key, True)]
    b.worker.start_loads(plan.loads)
    assert [block_bytes_of(b.caches, x) for x in target[:3]] == [block_bytes_of(a.caches, x) for x in range(3)]
    totals = b.sched.counters.totals
    assert (totals["tail_hit_tokens"], totals["served_tokens_disk"], totals["load_sync_fetch_requests"]) == (2, 2, 1)
    a.close(), none.close(), b.close()


@needs_etcd
def test_a_hit_with_blocks_at_a_peer_loads_in_the_step_within_the_budget() -> None:
    """Two daemons joined through etcd: the blocks node b does not hold (those not pushed to it) come from a;
    with a budget for them, b's load fetches them while the step waits and copies the exact bytes a saved."""
    with ExitStack() as stack:
        cluster = Cluster(stack, names=("a", "b"), timeout_s=5.0)
        a = Side(cluster.nodes["a"].address, make_caches(630))
        req = Req("p1", prompt_tokens(100, start=631))
        a.prefill(req, list(range(25)))
        cluster.wait_pushes("a")
        ns = namespace_for(SPEC)
        keys = KeyChain(T, 0, chain_root(0)).extend(req.prompt_token_ids)
        on_a_only = sum(cluster.owner(ns, k) == "a" for k in keys)
        b = Side(cluster.nodes["b"].address, make_caches(631), load_mode="auto", sync_fetch_bytes=on_a_only * KEY_BYTES)
        again = Req("p2", list(req.prompt_token_ids))
        assert b.sched.num_new_matched_tokens(again, 0) == (96, False)
        # a's blocks come from the peer, or from RAM when the probe's background fetch lands first (a race)
        peer = b.sched.counters.totals.get("served_tokens_peer", 0)
        assert peer <= on_a_only * T and b.sched.counters.totals["served_tokens_ram"] == 96 - peer
        target = list(range(30, 55))
        b.sched.after_alloc(again, [target], 96)
        plan = b.sched.build([ScheduledRequest("p2", [target], True, 4)])
        assert [j.sync for j in plan.loads] == [True]
        b.worker.start_loads(plan.loads)
        assert [block_bytes_of(b.caches, x) for x in target[:24]] == [block_bytes_of(a.caches, x) for x in range(24)]
        assert b.worker.finished(set()) == (set(), set()) and b.worker.load_errors() == set()
        assert b.sched.counters.totals["load_sync_fetch_requests"] == int(peer > 0)
        assert cluster.counters("b")["fetched_blocks"] == on_a_only   # every block a alone held, fetched once
        a.close(), b.close()


@needs_etcd
def test_a_tail_that_only_a_peer_holds_is_found_and_loaded_with_exact_bytes() -> None:
    """The scheduler's tail question is cluster-wide: a's request saved its partial last block, which only a holds
    (a owns its key, so no push moved it); b's next turn of that context finds it through the owner and loads its
    exact bytes, tail included. The same lookup with the Exists kept local would stop at the full blocks."""
    with ExitStack() as stack:
        cluster = Cluster(stack, names=("a", "b"), timeout_s=5.0, peer_handoff_window_s=0)
        ns = namespace_for(S1)
        for start in range(640, 1640, 10):        # a request whose tail key a owns
            first = Req(f"t1-{start}", prompt_tokens(10, start=start), output=[901])
            full = KeyChain(T1, 0, chain_root(0)).extend(first.prompt_token_ids)
            tail_key = tail_keys(full[1], first.prompt_token_ids[8:], 0)[-1]
            if cluster.owner(ns, tail_key) == "a":
                break
        a = Side(cluster.nodes["a"].address, make_caches(start), S1, save="all", load_mode="auto")
        _run(a, first, [0, 1, 2])
        assert _finish(a, first, [0, 1, 2])[0] is True
        cluster.wait_pushes("a")
        b = Side(cluster.nodes["b"].address, make_caches(start + 1), S1, save="all", load_mode="auto")
        with Client(cluster.nodes["b"].address) as cb:
            # b knows the namespace only once something registers it there: a's pushes do when b owns one of its
            # keys (which one owns what follows the daemons' random ports), b's scheduler at its first lookup
            # (below). Registered here with the connector's own arguments, so the check does not hang on chance.
            cb.register_namespace(ns, **registration(S1))
            wait_until(lambda: cb.exists(ns, [tail_key], cluster=True) == [True], 30, what="the tail, seen from b")
            assert cb.exists(ns, [tail_key]) == [False]        # b itself does not hold it
        before = cluster.counters("b")
        req = Req("t2", first.all_token_ids + prompt_tokens(5, start=start + 50))
        assert b.sched.num_new_matched_tokens(req, 0) == (10, False)
        assert b.sched.counters.totals["tail_hit_tokens"] == 2
        after = cluster.counters("b")
        assert after["exists_remote_calls"] - before["exists_remote_calls"] == 1
        assert after["exists_remote_hits"] - before["exists_remote_hits"] == 1
        target = [20, 21, 22, 23]
        b.sched.after_alloc(req, [target], 10)
        req.num_computed_tokens = 10
        plan = b.sched.build([ScheduledRequest("t2", [target], True, 6)])
        b.worker.start_loads(plan.loads)
        assert [block_bytes_of(b.caches, x) for x in target[:3]] == [block_bytes_of(a.caches, x) for x in range(3)]
        a.close(), b.close()
