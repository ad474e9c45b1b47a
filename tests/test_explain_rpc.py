"""Client.explain through a real daemon (the Explain RPC): every cause a user can meet with exact fields, batches
split at max_batch_keys in order, bad input answered with a clear error while the daemon keeps serving, and
tenant isolation (a foreign namespace is unknown, another tenant's holders never show).

Ages are bounded by the test's own clock around the removal: the daemon's ledger keeps milliseconds, so an age is
at least the pause the test makes after the removal and at most the time from the removal to the answer.
"""

from __future__ import annotations

import time

import pytest

from kvstore import Client
from kvstore.client import KeyExplanation
from kvstore.errors import InvalidRequestError, UnknownNamespaceError
from kvstore.testing import DaemonProcess
from kvstore.vocab import Tier
from tests.tenant_helpers import A_NS, B_NS, two_tenant_daemon

pytestmark = pytest.mark.timeout(90)
A, B = "explain/a", "explain/b"
BLOCK = b"v" * (1 << 20)
PAUSE_S = 0.02  # the least age a removal has when explained


def _aged(e: KeyExplanation, cause: str, left_at: float, answered_at: float, policy: str = "") -> None:
    """Absent for `cause`, left between `left_at` and the answer (the test's monotonic clock)."""
    assert (e.tier, e.cause, e.policy, e.other_namespaces) == (Tier.NONE, cause, policy, ())
    assert PAUSE_S <= e.age_s <= answered_at - left_at + 0.002, (e.age_s, answered_at - left_at)


def test_every_cause_through_a_real_daemon_with_exact_fields(make_daemon) -> None:
    # a 4 MiB arena holds four 1 MiB blocks; no disk tier, so an eviction is the block's end
    d = make_daemon(arena_bytes="4MiB", max_block_bytes="1MiB", high_watermark=1.0, low_watermark=1.0,
                    disk_bytes=0)
    with d.client() as c:
        assert c.stats().policy == "lru"
        c.register_namespace(A)
        c.register_namespace(B)
        c.put_many(A, [b"a0", b"a1", b"a2", b"a3"], [BLOCK] * 4)   # full
        t_evict = time.monotonic()
        c.put(A, b"a4", BLOCK)                  # evicts a0 (least recently used)
        t_delete = time.monotonic()
        assert c.delete(A, [b"a1"]) == 1
        c.put(B, b"b0", BLOCK)                  # into a1's slot
        t_clear = time.monotonic()
        assert c.clear(B) == 1
        c.put(B, b"o", BLOCK)                   # B holds o; A never did
        time.sleep(PAUSE_S)                     # let the removals age (not a synchronisation)
        got = c.explain(A, [b"a3", b"a0", b"a1", b"o", b"zz", b"a4"])
        cleared = c.explain(B, [b"b0", b"o"])
        answered = time.monotonic()
        assert got[0] == KeyExplanation(Tier.RAM) and got[5] == KeyExplanation(Tier.RAM)
        assert got[0].present and not got[1].present
        _aged(got[1], "evicted", t_evict, answered, policy="lru")
        _aged(got[2], "deleted", t_delete, answered)
        assert got[1].age_s >= got[2].age_s    # a0 left first
        assert got[3] == KeyExplanation(Tier.NONE, "other_namespace", 0.0, "", (B,))
        assert got[4] == KeyExplanation(Tier.NONE, "never_stored")
        _aged(cleared[0], "cleared", t_clear, answered)
        assert cleared[1] == KeyExplanation(Tier.RAM)
        # stored again: present, and its record is gone (a later eviction would write a new one)
        assert c.delete(A, [b"a3"]) == 1
        c.put(A, b"a0", BLOCK)
        assert c.explain(A, [b"a0"]) == [KeyExplanation(Tier.RAM)]
        # read-only: explaining counted no lookup and no miss
        s = c.stats()
        assert {n.name: n.lookup_keys for n in s.namespaces} == {A: 0, B: 0}
        assert sum(v for k, v in s.counters.items() if k.startswith("misses_")) == 0


def test_batches_are_split_at_max_batch_keys_and_keep_their_order(make_daemon) -> None:
    d = make_daemon(arena_bytes="16MiB", max_block_bytes="1MiB", max_batch_keys=4)
    keys = [b"k%02d" % i for i in range(10)]
    with d.client() as c:
        assert c.max_batch_keys == 4
        c.register_namespace(A)
        c.put_many(A, keys[1::3], [b"x" * 100] * 3)             # k01, k04, k07
        got = c.explain(A, keys)
    assert [e.tier for e in got] == [Tier.RAM if i % 3 == 1 else Tier.NONE for i in range(10)]
    assert [e.cause for e in got if not e.present] == ["never_stored"] * 7


def test_bad_input_gets_a_clear_error_and_the_daemon_keeps_serving(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        with pytest.raises(UnknownNamespaceError, match="unknown namespace 'explain/nobody': register it first"):
            c.explain("explain/nobody", [b"k"])
        c.register_namespace(A)
        with pytest.raises(InvalidRequestError, match=r"^key 1 has 65 bytes: keys must be 1\.\.64 bytes$"):
            c.explain(A, [b"fine", b"y" * 65])
        with pytest.raises(InvalidRequestError, match=r"^key 0 has 0 bytes: keys must be 1\.\.64 bytes$"):
            c.explain(A, [b""])
        assert c.explain(A, []) == []
        c.put(A, b"ok", b"x")
        assert c.explain(A, [b"ok"]) == [KeyExplanation(Tier.RAM)]


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory):
    yield from two_tenant_daemon(tmp_path_factory.mktemp("tokens"))


def test_a_tenant_cannot_explain_another_tenants_namespace_nor_see_its_holders(tenants) -> None:
    daemon, alice_file, bob_file = tenants
    with Client(daemon.address, token_file=alice_file) as alice, Client(daemon.address, token_file=bob_file) as bob:
        alice.register_namespace(A_NS)
        alice.register_namespace(A_NS + "2")
        bob.register_namespace(B_NS)
        alice.put(A_NS, b"shared", b"alice's")
        bob.put(B_NS, b"shared", b"bob's")
        # the answer Describe gives for a foreign namespace: as if it did not exist
        with pytest.raises(UnknownNamespaceError) as describe_err:
            bob.describe(A_NS, [b"shared"])
        with pytest.raises(UnknownNamespaceError) as explain_err:
            bob.explain(A_NS, [b"shared"])
        assert str(explain_err.value) == str(describe_err.value)
        assert "unknown namespace 'model@abc/alice': register it first" in str(explain_err.value)
        # alice's A_NS2 lacks the key: only her own A_NS is named, never bob's B_NS
        assert alice.explain(A_NS + "2", [b"shared"]) == [KeyExplanation(Tier.NONE, "other_namespace", 0.0, "",
                                                                          (A_NS,))]
        # once alice's copy is gone only bob holds the key: to alice it was never stored in A_NS2
        alice.delete(A_NS, [b"shared"])
        got = alice.explain(A_NS + "2", [b"shared"])
        assert got == [KeyExplanation(Tier.NONE, "never_stored")]  # bob's copy does not leak
        assert alice.explain(A_NS, [b"shared"])[0].cause == "deleted"
