"""Partial last blocks (kvstore_connector/tails.py) through the connector's two sides and a real daemon: a finished
request stores its tail and vLLM holds its blocks until the worker has gathered it (reported once, whatever the
save's fate); the next turn's lookup hits into the block and the load copies its exact bytes; the longest stored
tail wins, a diverging one does not hit; tails stay off where they cannot be loaded (several vLLM blocks per
stored block, tails false); an asynchronous load takes a tail too. The same under the real vLLM scheduler:
tests/vllm_sched/test_vllm_scheduler_tails.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvstore_connector.keys import KeyChain, chain_root, tail_keys
from kvstore_connector.namespace import namespace_for
from kvstore_connector.scheduler import ScheduledRequest
from kvstore.client import Client
from kvstore.testing import free_port
from tests.connector_helpers import SPEC, Req, Side, block_bytes_of, make_caches, prompt_tokens
from tests.control_paths import per_path_daemon

pytestmark = pytest.mark.usefixtures("control_path")  # every test over the fast path and over gRPC
daemon = per_path_daemon()

S1 = replace(SPEC, blocks_per_key=1)  # one stored block per vLLM block: where tails are on
T1 = S1.tokens_per_key                # 4 tokens


def _run(side: Side, req: Req, table: list[int]) -> list:
    """The whole prompt in one step (blocks `table`), then its save; returns that step's save jobs."""
    side.sched.track(req)
    plan = side.sched.build([ScheduledRequest(req.request_id, [table], True, len(req.prompt_token_ids))])
    side.worker.save(plan.saves)
    side.worker.drain()
    req.num_computed_tokens = len(req.prompt_token_ids)
    return plan.saves


def _finish(side: Side, req: Req, table: list[int]) -> tuple[bool, list, set[str]]:
    """vLLM finishing `req` (its blocks `table`), then the next step: (blocks held?, that step's saves, the
    requests the worker reports sent)."""
    keep = side.sched.request_finished(req, table)
    plan = side.sched.build([], {req.request_id})
    side.worker.save(plan.saves)
    sent = side.worker.finished({req.request_id})[0]
    side.worker.drain()
    return keep, plan.saves, sent


def test_a_turn_that_stopped_early_stores_its_tail_and_the_next_turn_loads_into_that_block(daemon) -> None:
    """A request that stops before max_tokens (EOS, a stop string): its tail is final only once it finishes, so
    vLLM holds its blocks until the worker has gathered it in the next step."""
    a = Side(daemon.address, make_caches(80), S1, save="all", load_mode="auto")
    first = Req("t1", prompt_tokens(10, start=11), output=[901])  # 10 tokens computed: 2 full keys + 2 tokens
    _run(a, first, [0, 1, 2])
    tail_bytes = block_bytes_of(a.caches, 2)
    keep, saves, sent = _finish(a, first, [0, 1, 2])
    assert keep is True and sent == {"t1"} and a.worker.finished(set()) == (set(), set())  # reported once
    key = tail_keys(KeyChain(T1, 0, chain_root(0)).extend(first.prompt_token_ids)[1], first.prompt_token_ids[8:],
                    0)[-1]
    assert [(j.keys, j.block_ids, j.release) for j in saves] == [([key], [[2]], True)]
    for t in a.caches.values():                  # vLLM frees the blocks after the report and reuses them
        t[:, 2] = -7.0
    with Client(daemon.address) as c:
        assert c.get_many(namespace_for(S1), [key]) == [tail_bytes]
    assert a.sched.counters.totals["tail_saves"] == 1

    b = Side(daemon.address, make_caches(81), S1, save="all", load_mode="auto")
    turn = Req("t2", first.all_token_ids + prompt_tokens(5, start=500))  # 16 tokens: context, answer, new
    assert b.sched.num_new_matched_tokens(turn, 0) == (10, False)   # 2 keys + the 2-token tail, synchronous
    target = [20, 21, 22, 23]
    b.sched.after_alloc(turn, [target], 10)
    turn.num_computed_tokens = 10                # vLLM counts the hit computed before it builds the step
    plan = b.sched.build([ScheduledRequest("t2", [target], True, 6)])
    assert [(len(j.keys), j.keys[-1], j.block_ids, j.sync) for j in plan.loads] == [(3, key, [[20, 21, 22]], True)]
    b.worker.start_loads(plan.loads)
    assert [block_bytes_of(b.caches, x) for x in target[:3]] == [block_bytes_of(a.caches, 0),
                                                                 block_bytes_of(a.caches, 1), tail_bytes]
    assert b.worker.load_errors() == set()
    # the block vLLM completes from the tail is saved as the full key it then is, with the one after it
    full = KeyChain(T1, 0, chain_root(0)).extend(turn.prompt_token_ids)
    assert [(j.keys, j.block_ids) for j in plan.saves] == [(full[2:4], [[22, 23]])]
    assert (b.sched.counters.totals["tail_hit_tokens"], b.worker.counters.totals["loaded_blocks"]) == (2, 3)
    assert b.sched.counters.totals["served_tokens_ram"] == 2 * T1 + 2   # the tail served from RAM too
    a.close(), b.close()


def test_the_longest_stored_tail_wins_and_a_diverging_one_does_not_hit(daemon) -> None:
    a = Side(daemon.address, make_caches(82), S1, save="all", load_mode="auto")
    head = prompt_tokens(8, start=41)
    for rid, tail, blocks in (("short", [7], [0, 1, 2]), ("long", [7, 8, 9], [3, 4, 5])):
        req = Req(rid, head + tail)
        _run(a, req, blocks)
        assert _finish(a, req, blocks)[0] is True
    for rid, rest, hit in (("p1", [7, 8, 9, 10, 11], 11), ("p2", [7, 3, 3, 3], 9), ("p3", [6, 8, 9, 10], 8),
                           ("p4", [7, 8], 9)):  # p4: 10 tokens, the last one computed by vLLM: at most 9
        assert a.sched.num_new_matched_tokens(Req(rid, head + rest), 0) == (hit, False), rid
    a.close()


def test_a_resent_prompt_hits_all_but_its_last_token(daemon) -> None:
    """A prompt ending inside a block: its stored tail, offered but for the last token; a prompt filling its last
    block (no tail): that block's full key, offered but for the last token. vLLM recomputes that token's
    position over the loaded block."""
    a = Side(daemon.address, make_caches(90), S1, save="prompt", load_mode="auto")
    for rid, n, blocks in (("ends-inside", 10, [0, 1, 2]), ("fills", 12, [3, 4, 5])):
        req = Req(rid, prompt_tokens(n, start=171 + n))
        saves = _run(a, req, blocks)                 # save "prompt": the tail goes with the prompt's last token
        assert [j.release for j in saves] == [False] * (1 + (n % T1 != 0))
        assert _finish(a, req, blocks)[:2] == (False, [])
        again = Req(rid + "-again", list(req.prompt_token_ids))
        assert a.sched.num_new_matched_tokens(again, 0) == (n - 1, False), rid
        a.sched.after_alloc(again, [[10, 11, 12]], n - 1)
        again.num_computed_tokens = n - 1
        (job,) = a.sched.build([ScheduledRequest(again.request_id, [[10, 11, 12]], True, 1)]).loads
        chain = KeyChain(T1, 0, chain_root(0)).extend(req.prompt_token_ids)
        last = chain[2] if n == 12 else tail_keys(chain[1], req.prompt_token_ids[8:], 0)[-1]
        assert (job.keys, job.block_ids) == ([*chain[:2], last], [[10, 11, 12]]), rid
        a.worker.start_loads([job])
        assert [block_bytes_of(a.caches, x) for x in (10, 11, 12)] == [block_bytes_of(a.caches, x) for x in blocks]
    a.close()


def test_save_prompt_stores_the_prompts_tail_not_the_answer(daemon) -> None:
    a = Side(daemon.address, make_caches(83), S1, save="prompt", load_mode="auto")
    req = Req("sp", prompt_tokens(10, start=61), output=[5, 6])
    _run(a, req, [0, 1, 2])
    req.num_computed_tokens = 11                    # one decode step wrote the first answer token's KV
    assert _finish(a, req, [0, 1, 2])[:2] == (False, [])  # saved with the prompt's last token: nothing to hold
    turn = Req("sp2", req.all_token_ids + [1, 2, 3])
    assert a.sched.num_new_matched_tokens(turn, 0) == (10, False)   # the prompt's 2 tokens, not the answer's
    a.close()


def test_a_turn_that_runs_to_max_tokens_saves_its_tail_in_its_last_step(daemon) -> None:
    """The step that samples the last token (max_tokens) writes the last of the tail's KV: the tail is saved in
    that step, and vLLM frees the blocks at once when the request finishes."""
    a = Side(daemon.address, make_caches(92), S1, save="all", load_mode="auto")
    req = Req("mt", prompt_tokens(9, start=191), max_tokens=3)     # final KV: 9 + 2 = 11 tokens, tail of 3
    assert [len(j.keys) for j in _run(a, req, [0, 1, 2])] == [2]  # the full keys only
    saves_by_step = []
    for out in ([5], [5, 6]):                        # two decode steps, the second samples the last token
        req.output = out
        plan = a.sched.build([ScheduledRequest("mt", None, False, 1)])
        req.num_computed_tokens += 1
        a.worker.save(plan.saves)
        saves_by_step.append([(len(j.keys), j.block_ids, j.release) for j in plan.saves])
    assert saves_by_step == [[], [(1, [[2]], False)]]
    assert _finish(a, req, [0, 1, 2])[:2] == (False, [])
    assert a.sched.num_new_matched_tokens(Req("mt2", req.all_token_ids[:11] + [1, 2]), 0) == (11, False)
    a.close()


def test_no_tail_where_it_cannot_be_loaded_or_is_not_wanted(daemon) -> None:
    """Several vLLM blocks per stored block (SPEC: 2) or tails false: request_finished holds nothing and a lookup
    stops at whole blocks. An asynchronous load (vLLM takes a hit ending inside a block as it is) is offered the
    tail, and this side holds its own finished request's blocks for its tail like any."""
    head = prompt_tokens(10, start=71)
    stored = Side(daemon.address, make_caches(84), S1, save="all", load_mode="auto")
    req = Req("src", list(head))
    _run(stored, req, [0, 1, 2])
    assert _finish(stored, req, [0, 1, 2])[0] is True
    for name, side, holds, hit in (
            ("two blocks a key", Side(daemon.address, make_caches(85), save="all", load_mode="auto"), False, None),
            ("tails false", Side(daemon.address, make_caches(86), S1, save="all", tails=False), False, (8, True)),
            ("async", Side(daemon.address, make_caches(87), S1, save="all", load_mode="async"), True, (10, True))):
        r = Req("x-" + name, prompt_tokens(10, start=91))
        _run(side, r, [0, 1, 2, 3, 4])
        assert side.sched.request_finished(r, [0, 1, 2, 3, 4]) is holds, name
        assert [j.release for j in side.sched.build([], {r.request_id}).saves] == [True] * holds, name
        if hit is not None:                          # the same 4-token keys: the stored tail is there
            assert side.sched.num_new_matched_tokens(Req("y-" + name, head + [3]), 0) == hit, name
        side.worker.drain()
        side.close()
    stored.close()


def test_a_request_that_computed_nothing_or_is_still_loading_holds_nothing(daemon) -> None:
    a = Side(daemon.address, make_caches(88), S1, save="all", load_mode="async")
    idle = Req("idle", prompt_tokens(10, start=111))
    a.sched.track(idle)
    assert a.sched.request_finished(idle, []) is False          # aborted while waiting: no blocks
    src = Req("src2", prompt_tokens(12, start=131))
    _run(a, src, [0, 1, 2])
    a.worker.drain()
    loading = Req("loading", src.prompt_token_ids + [1, 2])
    assert a.sched.num_new_matched_tokens(loading, 0) == (12, True)
    a.sched.after_alloc(loading, [[10, 11, 12, 13]], 12)      # its load may still write its blocks
    assert a.sched.request_finished(loading, [10, 11, 12, 13]) is False
    a.close()


def test_the_worker_reports_a_tail_sent_when_its_save_fails(tmp_path) -> None:
    """A request vLLM holds for its tail is reported in the next step even with the store down: a request never
    reported would keep its blocks forever."""
    s = Side(f"127.0.0.1:{free_port()}", make_caches(89), S1, save="all", lookup_timeout_s=0.2)
    req = Req("down", prompt_tokens(6, start=151))
    s.sched.track(req)
    s.sched.build([ScheduledRequest("down", [[0, 1]], True, 6)])
    req.num_computed_tokens = 6
    keep, saves, sent = _finish(s, req, [0, 1])
    assert (keep, [j.release for j in saves], sent) == (True, [True], {"down"})
    assert s.worker.counters.totals["save_failures"] >= 1
    s.close()


def test_the_daemon_counts_one_lookup_key_per_tail_found_not_every_length_asked(daemon) -> None:
    """The lookup asks which of up to 3 tail lengths exist without a counted lookup, then probes the one it
    takes: the daemon's lookup and hit counters (its hit rate) move by exactly that one key."""
    a = Side(daemon.address, make_caches(93), S1, save="prompt", load_mode="auto")
    head = prompt_tokens(8, start=231)
    _run(a, Req("src3", head + [4, 5]), [0, 1, 2])     # 2 full keys and a 2-token tail
    ns = namespace_for(S1)

    def counted(req: Req) -> tuple[int, int, int]:
        with Client(daemon.address) as c:
            before = next(n for n in c.stats().namespaces if n.name == ns)
            hit = a.sched.num_new_matched_tokens(req, 0)[0]
            after = next(n for n in c.stats().namespaces if n.name == ns)
        return hit, after.lookup_keys - before.lookup_keys, after.hit_keys - before.hit_keys

    with_tail, without = counted(Req("w", head + [4, 5, 6, 7, 8])), counted(Req("wo", head + [9, 5, 6, 7, 8]))
    assert (with_tail[0], without[0]) == (10, 8)
    assert (with_tail[1] - without[1], with_tail[2] - without[2], without[2]) == (1, 1, 2)
    a.close()


def test_no_tail_is_asked_for_after_no_hit(daemon) -> None:
    """A tail after no full block is a whole context of less than a block, cheap to recompute; asking costs every
    prompt that hits nothing a round trip, so it is not asked: a resent 3-token prompt's stored tail is not
    offered."""
    a = Side(daemon.address, make_caches(94), S1, save="prompt", load_mode="auto")
    short = Req("short", [5, 6, 7])
    assert [j.release for j in _run(a, short, [0])] == [False]   # its tail is stored
    assert a.sched.num_new_matched_tokens(Req("again", [5, 6, 7, 8]), 0) == (0, False)
    assert a.sched.counters.totals.get("tail_hit_tokens", 0) == 0
    a.close()
