"""Client.hint through a real daemon (the Hint RPC): every action with the outcomes an orchestrator meets, exact
per key and in kvstore_hints_total{action,outcome} on /metrics; the disk tier's demote and prefetch; batches split
at max_batch_keys in order; bad actions and ttls answered INVALID_ARGUMENT with the engine's words while the
daemon keeps serving; tenant isolation (a foreign namespace is unknown, its pins untouched).
"""

from __future__ import annotations

import math
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore import Client
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client import HintAction, HintOutcome
from kvstore.errors import InvalidRequestError, UnknownNamespaceError
from kvstore.hint_vocab import HINT_COUNTER_NAMES
from kvstore.testing import DaemonProcess
from kvstore.testing.fuzz import METHODS, FuzzStats, Pools, RandomSource, fuzz_rpc
from tests.tenant_helpers import A_NS, ALICE_TOKEN, B_NS, BOB_TOKEN, secret

pytestmark = pytest.mark.timeout(90)
NS = "hint/a"
BLOCK = b"v" * (1 << 20)
ACC, CLIP, DEF, REJ, MISS = (HintOutcome.ACCEPTED, HintOutcome.CLIPPED, HintOutcome.DEFERRED, HintOutcome.REJECTED,
                             HintOutcome.MISSING)


def scrape_hints(d: DaemonProcess) -> dict[str, float]:
    """kvstore_hints_total as {"<action>_<outcome>": value}, every sample the daemon serves."""
    with urllib.request.urlopen(d.metrics_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {f"{s.labels['action']}_{s.labels['outcome']}": s.value for fam in text_string_to_metric_families(text)
            if fam.name == "kvstore_hints" for s in fam.samples if s.name == "kvstore_hints_total"}


def nonzero(counts: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in counts.items() if v}


def wait_tiers(c: Client, keys: list[bytes], want: list[str], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    got: list[str | None] = []
    while time.monotonic() < deadline:
        got = [i.tier if i is not None else None for i in c.describe(NS, keys)]
        if got == want:
            return
        time.sleep(0.01)
    raise AssertionError(f"{what}: tiers {got}, wanted {want}")


def test_every_action_without_a_disk_tier_with_exact_outcomes_and_metrics(make_daemon) -> None:
    # 4 MiB arena, no disk: the pin budget is half the arena, two 1 MiB blocks; retain/pin ttls cut at 30 s
    d = make_daemon(arena_bytes="4MiB", max_block_bytes="1MiB", high_watermark=1.0, low_watermark=1.0,
                    disk_bytes=0, hint_max_ttl_s=30)
    assert scrape_hints(d) == {n.removeprefix("hint_"): 0 for n in HINT_COUNTER_NAMES}  # 25 pairs, all zero
    with d.client() as c:
        c.register_namespace(NS)
        c.put_many(NS, [b"a", b"b", b"c"], [BLOCK] * 3)
        assert c.hint(NS, [b"a", b"zz"], "retain", 5) == [ACC, MISS]
        assert c.hint(NS, [b"a"], HintAction.RETAIN, 3600) == [CLIP]
        assert c.hint(NS, [b"c", b"zz"], "release") == [ACC, MISS]
        assert c.hint(NS, [b"a", b"zz"], "demote") == [REJ, MISS]     # no disk tier
        assert c.hint(NS, [b"b", b"zz"], "PREFETCH") == [ACC, MISS]   # case does not matter
        assert c.hint(NS, [b"a", b"b", b"c", b"zz"], "pin", 10) == [ACC, ACC, REJ, MISS]  # budget: 2 MiB
        assert c.hint(NS, [b"a"], "pin", 999) == [CLIP]               # extended, counted once
        assert [i.pins for i in c.describe(NS, [b"a", b"b", b"c"]) if i is not None] == [1, 1, 0]
        # hints steer eviction only: every block still reads back as stored
        assert c.get_many(NS, [b"a", b"b", b"c"]) == [BLOCK] * 3
        assert all(isinstance(o, HintOutcome) for o in c.hint(NS, [b"c"], "release"))
        counters = c.stats().counters
    want = {"retain_accepted": 1, "retain_clipped": 1, "retain_missing": 1, "release_accepted": 2,
            "release_missing": 1, "demote_rejected": 1, "demote_missing": 1, "prefetch_accepted": 1,
            "prefetch_missing": 1, "pin_accepted": 2, "pin_rejected": 1, "pin_missing": 1, "pin_clipped": 1}
    assert nonzero(scrape_hints(d)) == want
    assert {k: v for k, v in counters.items() if k.startswith("hint_") and v} == {f"hint_{k}": v
                                                                                   for k, v in want.items()}


def test_demote_and_prefetch_move_blocks_between_ram_and_disk(make_daemon) -> None:
    # disk_write = commit: written behind, so a Demote only drops RAM copies (evict: test_engine_disk_write.py)
    d = make_daemon(arena_bytes="8MiB", max_block_bytes="1MiB", disk_bytes="16MiB", disk_segment_bytes="4MiB",
                    disk_sync="none", disk_write="commit")
    with d.client() as c:
        c.register_namespace(NS)
        c.put_many(NS, [b"a", b"b"], [BLOCK] * 2)
        wait_tiers(c, [b"a", b"b"], ["ram+disk", "ram+disk"], "written behind at commit (admission always)")
        assert c.hint(NS, [b"a", b"zz"], "demote") == [ACC, MISS]      # a disk copy: RAM freed now
        assert [i.tier for i in c.describe(NS, [b"a"]) if i is not None] == ["disk"]
        assert c.hint(NS, [b"a"], "demote") == [ACC]                   # only on disk already
        assert c.hint(NS, [b"a"], "retain", 5) == [REJ]                # nothing in RAM to keep: prefetch first
        assert c.hint(NS, [b"a", b"b", b"zz"], "prefetch") == [ACC, ACC, MISS]
        wait_tiers(c, [b"a"], ["ram+disk"], "a promoted by the prefetch")
        assert c.get(NS, b"a") == BLOCK
        assert c.hint(NS, [b"a"], "retain", 5) == [ACC]
    assert nonzero(scrape_hints(d)) == {"demote_accepted": 2, "demote_missing": 1, "retain_rejected": 1,
                                        "prefetch_accepted": 2, "prefetch_missing": 1, "retain_accepted": 1}


def test_hints_on_blocks_being_written_are_deferred_to_their_commit(make_daemon) -> None:
    # The connector's case: a turn's Retain/Pin reaches the daemon while its last blocks' Commit is pending.
    d = make_daemon(arena_bytes="4MiB", max_block_bytes="1MiB", high_watermark=1.0, low_watermark=1.0,
                    disk_bytes=0)
    with d.client() as c:
        c.register_namespace(NS)
        c.put(NS, b"a", BLOCK)
        r = c.reserve(NS, [b"b", b"c"], [len(BLOCK)] * 2)
        assert c.hint(NS, [b"b", b"a"], "pin", 60) == [DEF, ACC]
        assert c.hint(NS, [b"c"], "release") == [DEF]
        assert c.describe(NS, [b"b", b"c"]) == [None, None]  # not visible until committed
        assert c.commit(r) == 2
        assert [i.pins for i in c.describe(NS, [b"a", b"b", b"c"]) if i is not None] == [1, 1, 0]
        c.put(NS, b"d", BLOCK)
        c.put(NS, b"e", BLOCK)  # the arena's 4 slots are full: c, released at its commit, goes first
        assert c.exists(NS, [b"a", b"b", b"c", b"d", b"e"]) == [True, True, False, True, True]
        r = c.reserve(NS, [b"f"], [len(BLOCK)])
        assert c.hint(NS, [b"f"], "pin", 60) == [DEF]
        assert c.abort(r) == 1  # an aborted write's hints go with it
        assert c.stats().counters["hints_late_rejected"] == 0
    assert nonzero(scrape_hints(d)) == {"pin_deferred": 2, "pin_accepted": 1, "release_deferred": 1}


def test_batches_are_split_at_max_batch_keys_and_keep_their_order(make_daemon) -> None:
    d = make_daemon(arena_bytes="16MiB", max_block_bytes="1MiB", max_batch_keys=4)
    stored = [b"k%02d" % i for i in (1, 4, 7)]
    asked = sorted(stored + [b"k%02d" % i for i in (0, 2, 3, 5, 6, 8, 9)])  # 10 keys: batches of 4, 4 and 2
    with d.client() as c:
        c.register_namespace(NS)
        c.put_many(NS, stored, [b"x" * 100] * len(stored))
        outcomes = c.hint(NS, asked, "release")
        assert c.hint(NS, [], "release") == []                     # no keys: no call
        batch = c.max_batch_keys
    assert batch == 4 and outcomes == [ACC if k in stored else MISS for k in asked]
    assert nonzero(scrape_hints(d)) == {"release_accepted": 3, "release_missing": 7}


BAD = [("bogus", 0.0, "unknown hint action 'bogus': use one of retain, release, demote, prefetch, pin"),
       ("", 0.0, "unknown hint action '': use one of retain, release, demote, prefetch, pin"),
       ("release", -1.0, "hint ttl_s=-1.0: use a finite number of seconds >= 0"),
       ("retain", math.nan, "hint ttl_s=nan: use a finite number of seconds >= 0"),
       ("retain", math.inf, "hint ttl_s=inf: use a finite number of seconds >= 0"),
       ("retain", 0.0, "hint retain needs ttl_s > 0 (how long to keep the blocks), got 0.0"),
       ("pin", 0.0, "hint pin needs ttl_s > 0 (how long to keep the blocks), got 0.0")]


@pytest.fixture(scope="module")
def daemon():
    with DaemonProcess(arena_bytes="16MiB", max_block_bytes="1MiB") as d:
        yield d


@pytest.mark.parametrize("action,ttl,message", BAD)
def test_bad_action_or_ttl_is_invalid_argument_and_the_daemon_keeps_serving(daemon: DaemonProcess, action: str,
                                                                            ttl: float, message: str) -> None:
    with daemon.client() as c:
        c.register_namespace(NS)
        c.put(NS, b"ok", b"x")
        with pytest.raises(InvalidRequestError) as err:
            c.hint(NS, [b"ok"], action, ttl)
        assert str(err.value) == message
        # on the wire: INVALID_ARGUMENT with the reason invalid_request
        ch = grpc.insecure_channel(daemon.address)
        try:
            with pytest.raises(grpc.RpcError) as raw:
                pb_grpc.KVStoreStub(ch).Hint(pb.HintRequest(namespace=NS, keys=[b"ok"], action=action, ttl_s=ttl))
            assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT and raw.value.details() == message
            assert dict(raw.value.trailing_metadata())["kvstore-reason"] == "invalid_request"
        finally:
            ch.close()
        assert c.hint(NS, [b"ok"], "retain", 1) == [ACC]


def test_bad_keys_namespace_and_ttl_type_get_clear_errors(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        with pytest.raises(UnknownNamespaceError, match="unknown namespace 'hint/nobody': register it first"):
            c.hint("hint/nobody", [b"k"], "release")
        c.register_namespace(NS)
        with pytest.raises(InvalidRequestError, match=r"^key 1 has 65 bytes: keys must be 1\.\.64 bytes$"):
            c.hint(NS, [b"fine", b"y" * 65], "release")
        with pytest.raises(InvalidRequestError, match=r"^hint ttl_s='5': use a finite number of seconds >= 0$"):
            c.hint(NS, [b"fine"], "retain", "5")  # type: ignore[arg-type]  # a caller's mistake, refused here
        assert c.hint(NS, [b"fine"], "release") == [MISS]


def tenant_files(d: Path) -> tuple[str, str, str]:
    """The daemon's tokens file, then alice's and bob's token files (owner-only), in `d`."""
    return (secret(str(d / "tokens"), f"alice {ALICE_TOKEN}\nbob {BOB_TOKEN}\n"),
            secret(str(d / "alice.token"), ALICE_TOKEN + "\n"), secret(str(d / "bob.token"), BOB_TOKEN + "\n"))


def test_a_tenant_cannot_hint_another_tenants_namespace(tmp_path: Path) -> None:
    tokens, alice_file, bob_file = tenant_files(tmp_path)
    with DaemonProcess(tokens_file=tokens) as daemon:
        with Client(daemon.address, token_file=alice_file) as alice, Client(daemon.address,
                                                                            token_file=bob_file) as bob:
            alice.register_namespace(A_NS)
            bob.register_namespace(B_NS)
            alice.put(A_NS, b"k", b"alice's")
            bob.put(B_NS, b"k", b"bob's")
            with pytest.raises(UnknownNamespaceError) as describe_err:
                bob.describe(A_NS, [b"k"])
            for action, ttl in (("pin", 5.0), ("release", 0.0), ("demote", 0.0), ("prefetch", 0.0)):
                with pytest.raises(UnknownNamespaceError) as hint_err:
                    bob.hint(A_NS, [b"k"], action, ttl)
                assert str(hint_err.value) == str(describe_err.value)
            assert [i.pins for i in alice.describe(A_NS, [b"k"]) if i is not None] == [0]  # untouched
            assert bob.hint(B_NS, [b"k"], "pin", 5) == [ACC]                              # his own: fine
            assert alice.hint(A_NS, [b"k"], "pin", 5) == [ACC]
            assert [i.pins for i in alice.describe(A_NS, [b"k"]) if i is not None] == [1]
        assert nonzero(scrape_hints(daemon)) == {"pin_accepted": 2}


def test_random_hint_requests_reach_every_action_and_never_break_the_daemon(daemon: DaemonProcess) -> None:
    """kvstore.testing.fuzz's generator on Hint alone (tests/test_fuzz.py sends it among every RPC): random
    namespaces, keys, actions and ttls; no INTERNAL, the daemon alive, and real outcomes counted for every action."""
    namespaces = ["hint/fz0", "hint/fz1"]
    with daemon.client() as c:
        for ns in namespaces:
            c.register_namespace(ns)
            c.put_many(ns, [b"k%d" % i for i in range(8)], [bytes([i]) * 1000 for i in range(8)])
        before = c.stats().counters
    method = next(m for m in METHODS if m.name == "Hint")
    stats, pools = FuzzStats(), Pools(namespaces)
    ch = grpc.insecure_channel(daemon.address)
    try:
        src = RandomSource(15)
        for _ in range(400):
            fuzz_rpc(ch, method, src, pools, stats)
    finally:
        ch.close()
    assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log()[-3000:]
    assert stats.calls == {"Hint": 400} and not stats.internal, stats.internal[:5]
    assert stats.codes["OK"] > 0 and stats.codes["INVALID_ARGUMENT"] > 0, stats.codes
    with daemon.client() as c:
        after = c.stats().counters
        assert c.hint(namespaces[0], [b"k0"], "release") == [ACC]  # still serving
    for action in HintAction:
        n = sum(after[f"hint_{action.value}_{o.value}"] - before[f"hint_{action.value}_{o.value}"]
                for o in HintOutcome)
        assert n > 0, f"no random {action.value} hint reached the engine"
