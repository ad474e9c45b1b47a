"""The shared key index end to end: a real daemon, real clients, real memfds over the same-node socket.

A client probes and looks up through its tenant's index and gets what a client with the index off gets, with
the same counter moves: answered by the client itself when every key is in the table (a one-way HITS, even
with the daemon stopped), else one PROBE or LOOKUP_IDS request; lease-less answers racing slot reuse never pair
a key with another block's bytes; another tenant's table holds none of the first tenant's keys and a client
cannot write its table; a daemon without an index, and a daemon killed and restarted under a client, still
give exact answers (never from the dead daemon's table; the client fetches the new one).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.client.fast_channel import request_key_index
from kvstore.errors import BatchTooLargeError, ConfigError, KVStoreError, StoreUnavailableError
from kvstore.fastpath import protocol as fp
from kvstore.fastpath.key_index import IndexView
from kvstore.server.config import load_config
from kvstore.testing import DaemonProcess, wait_until
from kvstore.vocab import Tier
from tests.fast_helpers import churning, counting, keyset, no_index_client, two_chains
from tests.tenant_helpers import A_NS, B_NS, two_tenant_daemon

COUNTED = ("lookup_calls", "lookup_keys", "hit_keys", "hit_keys_ram", "hit_keys_disk", "hit_keys_peer")


def moved(c: Client, run) -> tuple[object, dict[str, int]]:  # type: ignore[no-untyped-def]
    before = c.stats()
    out = run()
    after = c.stats()
    delta = {k: after.counters.get(k, 0) - before.counters.get(k, 0) for k in COUNTED}
    delta["fast_requests"] = after.control.fast_requests - before.control.fast_requests
    delta["ns_lookup_keys"] = sum(n.lookup_keys for n in after.namespaces) - sum(n.lookup_keys for n in before.namespaces)
    return out, delta


@pytest.fixture(scope="module")
def daemon():
    with DaemonProcess(arena_bytes="64MiB", disk_bytes="64MiB", disk_segment_bytes="4MiB") as d:
        yield d


def test_probes_through_the_index_answer_and_count_as_probes_without_it(daemon: DaemonProcess,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    keys = keyset("chain", 300)
    two_chains(daemon, ("ix/a", "ix/b"), keys)
    with Client(daemon.address, control="fast") as fast, no_index_client(daemon.address, monkeypatch) as plain:
        assert (fast.probe_path, plain.probe_path) == ("index", "daemon")
        chains = {"all held": keys[:280], "held, then new": keys, "new first": keys[290:] + keys[:10],
                  "one key": keys[:1]}
        for name, chain in chains.items():
            a, da = moved(fast, lambda: fast.probe_prefix_tiers(["ix/a"], chain))
            b, db = moved(plain, lambda: plain.probe_prefix_tiers(["ix/a"], chain))
            assert a == b, name
            assert {**da, "fast_requests": 0} == {**db, "fast_requests": 0}, name
            # every key in RAM: answered from the index, its effects sent one way (HITS), and Stats' settling Echo
            here = name in ("all held", "one key")
            assert (da["fast_requests"], db["fast_requests"], da["lookup_calls"]) == (2 if here else 1, 1, 1), name
        got, delta = moved(fast, lambda: fast.probe_prefix_many(["ix/a", "ix/b"], keys))
        assert got == (100, True) == plain.probe_prefix_many(["ix/a", "ix/b"], keys)
        assert delta["fast_requests"] == 2 and delta["lookup_keys"] == 600
        assert fast.delete("ix/a", keys[50:51]) == 1  # gone from RAM and disk: the index says so at once
        assert fast.probe_prefix("ix/a", keys) == plain.probe_prefix("ix/a", keys) == (50, True)


def test_another_tenant_sees_none_of_the_keys_and_no_one_can_write_a_table(tmp_path: Path) -> None:
    gen = two_tenant_daemon(tmp_path)
    d, alice_token, bob_token = next(gen)
    try:
        keys = keyset("secret", 20)
        with Client(d.address, token_file=alice_token, control="fast") as alice, \
                Client(d.address, token_file=bob_token, control="fast") as bob:
            alice.register_namespace(A_NS)
            bob.register_namespace(B_NS)
            alice.put_many(A_NS, keys, [b"a" * 100] * 20)
            bob.put_many(B_NS, keys[:5], [b"b" * 100] * 5)
            assert (alice.probe_path, bob.probe_path) == ("index", "index")
            assert alice.probe_prefix(A_NS, keys) == (20, True) and bob.probe_prefix(B_NS, keys) == (5, True)
            tables = {}
            for who, token_file in (("alice", alice_token), ("bob", bob_token)):
                fd, _ = request_key_index(d.socket_path + ".arena", open(token_file).read().strip())
                size = os.fstat(fd).st_size
                with pytest.raises(PermissionError):
                    mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                tables[who] = IndexView(fd)
            assert (tables["alice"].count, tables["bob"].count) == (20, 5)
            assert tables["bob"].probe(A_NS, keys) == (0, b"", b"")  # alice's keys are not in bob's table
            assert tables["alice"].probe(A_NS, keys)[0] == 20
            with pytest.raises(KVStoreError) as through_index:
                bob.probe_prefix(A_NS, keys)                      # and the daemon refuses bob alice's namespace
            with pytest.raises(type(through_index.value)):
                bob.lookup(A_NS, keys, prefix=True, lease=False)
            with pytest.raises(KVStoreError):
                request_key_index(d.socket_path + ".arena", "not-a-token-but-long-enough")
            # alice's entry ids and serials (guessable: small numbers) lease nothing to bob: not in his namespace,
            # and her namespace is refused him
            _, ids, serials = tables["alice"].probe(A_NS, keys)
            stolen = fp.encode_probe(B_NS, ids, serials, ())
            assert bob._control.channel.call(fp.LOOKUP_IDS, stolen, fp.LOOKUP_LEASE) == b""
            with pytest.raises(type(through_index.value)):
                bob._control.channel.call(fp.LOOKUP_IDS, fp.encode_probe(A_NS, ids, serials, ()), fp.LOOKUP_LEASE)
            assert alice.stats().leases_active == 0
    finally:
        gen.close()


def test_without_an_index_probes_go_to_the_daemon_and_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = keyset("off", 10)
    with DaemonProcess(arena_bytes="64MiB", key_index_entries=0) as d, Client(d.address, control="fast") as c:
        c.register_namespace("off/ns")
        c.put_many("off/ns", keys[:6], [b"x" * 64] * 6)
        assert c.probe_path == "daemon" and c.probe_prefix("off/ns", keys) == (6, True)
        with pytest.raises(StoreUnavailableError, match="key_index_entries = 0"):
            request_key_index(d.socket_path + ".arena", "")
    with DaemonProcess(arena_bytes="64MiB") as d:
        monkeypatch.setenv("KVSTORE_KEY_INDEX", "yes")
        with pytest.raises(ConfigError, match="KVSTORE_KEY_INDEX"):
            Client(d.address, control="fast")


def test_the_daemons_key_index_entries_setting_is_checked() -> None:
    base = ["--unix-socket", "/tmp/kvstore-index-test.sock", "--disk-bytes", "0"]
    assert load_config(base, env={}).key_index_entries == 262144
    assert load_config([*base, "--key-index-entries", "0"], env={}).key_index_entries == 0
    assert load_config(base, env={"KVSTORE_KEY_INDEX_ENTRIES": "1000"}).key_index_entries == 1000
    for bad in ("-1", str((1 << 26) + 1)):
        with pytest.raises(ConfigError, match=rf"key_index_entries={bad}: use 0 \(no shared key index\) to 67108864"):
            load_config([*base, "--key-index-entries", bad], env={})


def test_a_daemon_killed_and_restarted_under_a_probing_client(tmp_path: Path) -> None:
    keys = keyset("restart", 12)
    d = DaemonProcess(workdir=str(tmp_path), arena_bytes="64MiB")
    d.start()
    try:
        c = Client(d.address, control="fast")
        c.register_namespace("r/ns")
        c.put_many("r/ns", keys[:8], [b"v" * 64] * 8)
        assert c.probe_path == "index" and c.probe_prefix("r/ns", keys) == (8, True)
        assert c.probe_prefix("r/ns", keys[:8]) == (8, True)  # every key in the table: answered from it
        old = c._control.index.view()  # the table of the daemon about to die
        d.stop(signal.SIGKILL)
        assert old.probe("r/ns", keys)[0] == 8  # the dead daemon's table still maps, frozen: never trusted
        for chain in (keys, keys[:8]):  # a probe the daemon answers, and one the table alone would answer
            with pytest.raises(StoreUnavailableError):
                c.probe_prefix("r/ns", chain)
        d.start()
        c.register_namespace("r/ns")
        # the old table still says all 8 are held: the new daemon is asked, checks the old ids (none hold), and
        # counts one probe (the one-way HITS is never sent to a daemon other than the table's)
        got, delta = moved(c, lambda: c.probe_prefix("r/ns", keys[:8]))
        assert got == (0, True) and (delta["lookup_calls"], delta["lookup_keys"], delta["hit_keys"]) == (1, 8, 0)
        assert c.probe_prefix("r/ns", keys) == (0, True)
        new = c._control.index.view()
        assert new is not None and new is not old and new.incarnation != old.incarnation
        c.put_many("r/ns", keys[:3], [b"w" * 64] * 3)
        assert c.probe_prefix("r/ns", keys) == (3, True) and new.probe("r/ns", keys)[0] == 3
        c.close()
    finally:
        d.close()


def test_the_metrics_say_how_full_the_index_is() -> None:
    keys = keyset("metrics", 10)
    with DaemonProcess(arena_bytes="64MiB", key_index_entries=4) as d, d.client() as c:  # 8 slots: 6 keys at most
        c.register_namespace("m/ns")
        c.put_many("m/ns", keys, [b"x" * 64] * 10)
        assert c.probe_prefix("m/ns", keys) == (10, True)  # the 4 it could not index are found by the daemon
        text = urllib.request.urlopen(d.metrics_url + "/metrics", timeout=10).read().decode()
        assert "kvstore_key_index_tables 1.0" in text and "kvstore_key_index_keys 6.0" in text
        assert "kvstore_key_index_unindexed_total 4.0" in text
        assert c.delete("m/ns", keys[:3]) == 3
        text = urllib.request.urlopen(d.metrics_url + "/metrics", timeout=10).read().decode()
        assert "kvstore_key_index_keys 3.0" in text
    with DaemonProcess(arena_bytes="64MiB", key_index_entries=0) as d:
        text = urllib.request.urlopen(d.metrics_url + "/metrics", timeout=10).read().decode()
        assert "kvstore_key_index" not in text and "kvstore_fast_connections" in text


def test_lookups_and_gets_go_by_entry_ids_and_fall_back_to_keys_when_an_entry_moved(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = keyset("byid", 12)
    values = [np.full(4096, i, np.uint8) for i in range(12)]
    with Client(daemon.address, control="fast") as fast, no_index_client(daemon.address, monkeypatch) as plain:
        fast.register_namespace("ix/ids")
        fast.put_many("ix/ids", keys[:10], values[:10])
        for k in (keys[:10], keys[:4], keys):  # all indexed, a prefix of them, and some never stored
            for prefix in (False, True):
                a, da = moved(fast, lambda: fast.lookup("ix/ids", k, prefix=prefix, lease=False))
                b, db = moved(plain, lambda: plain.lookup("ix/ids", k, prefix=prefix, lease=False))
                assert (a.num_prefix, a.present, a.offsets, a.sizes, a.generations, a.checksums, a.tiers) == (
                    b.num_prefix, b.present, b.offsets, b.sizes, b.generations, b.checksums, b.tiers)
                assert a.id == b.id == 0 and a.incarnation == b.incarnation
                assert {**da, "fast_requests": 0} == {**db, "fast_requests": 0}
                # every key indexed: answered here (a one-way HITS, then Stats' settling Echo); else one Lookup
                assert (da["fast_requests"], db["fast_requests"]) == (2 if k != keys else 1, 1)
            got = fast.lookup("ix/ids", k, lease=True)  # with a lease: always the daemon's (by ids when indexed)
            assert got.id and got.hits == min(len(k), 10)
            fast.release([got], wait=True)
        buf = np.zeros(4096, np.uint8)
        assert fast.get_into("ix/ids", keys[7], buf) == 4096 and (buf == 7).all()
        wait_until(lambda: fast.stats().leases_active == 0, timeout_s=10, what="the get's background Release")
        view = fast._control.index.view()
        real = view.probe

        def stale(ns: str, ks: list[bytes]):  # what a client sees when an entry went between its read and the call
            n, ids, serials = real(ns, ks)
            return n, ids, bytes(b ^ 1 for b in serials[:1]) + serials[1:]
        monkeypatch.setattr(view, "probe", stale)
        got, delta = moved(fast, lambda: fast.lookup("ix/ids", keys[:10], lease=True))
        assert got.present == [True] * 10 and got.id  # the keys followed: the right answer, a real lease
        assert delta["fast_requests"] == 2 and delta["lookup_calls"] == 1 and delta["lookup_keys"] == 10
        fast.release([got], wait=True)


def test_a_probe_answered_from_the_index_waits_for_nothing_and_is_counted_after(daemon: DaemonProcess) -> None:
    """With the daemon stopped (SIGSTOP), a probe of keys all in the table still answers: no round trip. Its
    effects land when the daemon runs again; Stats from the same thread waits for them."""
    keys = keyset("stopped", 40)
    with Client(daemon.address, control="fast") as c:
        c.register_namespace("ix/stop")
        c.put_many("ix/stop", keys[:32], [b"s" * 256] * 32)
        assert c.probe_prefix("ix/stop", keys[:32]) == (32, True)  # fetches the table
        before = c.stats()
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            answers = [c.probe_prefix_tiers(["ix/stop"], keys[:n]) for n in (32, 5, 1)]
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert answers == [(n, [int(Tier.RAM)] * n) for n in (32, 5, 1)]
        after = c.stats()
        assert after.counters["lookup_calls"] - before.counters["lookup_calls"] == 3
        assert after.counters["lookup_keys"] - before.counters["lookup_keys"] == 38
        assert after.counters["hit_keys_ram"] - before.counters["hit_keys_ram"] == 38


def test_columns_answered_from_the_index_never_pair_a_key_with_another_blocks_slot(daemon: DaemonProcess) -> None:
    """A writer deletes and stores blocks of one size over and over (their slots are reused by other keys) while
    a reader looks them up without lease, answered from the index. Each answer's offset and generation, checked
    as a lease-less reader does (read the bytes, then the generation): whenever the generation still holds,
    the bytes are the answered key's, never another block's that took the slot."""
    keys = keyset("slots", 12)
    value = {k: bytes([i]) * 4096 for i, k in enumerate(keys)}
    with Client(daemon.address, control="fast") as c:
        c.register_namespace("ix/slots")
        c.put_many("ix/slots", keys, [value[k] for k in keys])
        here = counting(c._control, "_lookup_here")
        checked = stale = 0
        with churning(daemon, "ix/slots", keys, value.__getitem__):
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                for k in keys:
                    got = c.lookup("ix/slots", [k], lease=False)
                    if not got.hits:
                        continue
                    m = c.acquire_arena(got.incarnation)
                    assert m is not None
                    with m:
                        seen = ctypes.string_at(m.address + got.offsets[0], got.sizes[0])
                    if c.lease_valid(got) == [True]:
                        assert seen == value[k]
                        checked += 1
                    else:
                        stale += 1
        assert checked > 100 and sum(here) > 100, (checked, stale, sum(here), len(here))
        print(f"\n{checked} answers checked, {stale} stale by then, {sum(here)} of {len(here)} answered here")


def test_a_batch_the_daemon_refuses_is_refused_even_when_the_index_holds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Answering from the index must not accept what the daemon refuses: a Lookup of more keys than
    max_batch_keys gets the daemon's own error, even though every key is in the table; a probe, which the client
    splits into batches, answers."""
    keys = keyset("batch", 12)
    with DaemonProcess(arena_bytes="64MiB", max_batch_keys=8) as d, Client(d.address, control="fast") as c, \
            no_index_client(d.address, monkeypatch) as plain:
        c.register_namespace("b/ns")
        c.put_many("b/ns", keys, [b"k" * 64] * 12)  # two Reserves of 8 and 4
        assert c._control.index.view().probe("b/ns", keys)[0] == 12
        messages = []
        for lookup in (c.lookup, plain.lookup):
            with pytest.raises(BatchTooLargeError) as refused:
                lookup("b/ns", keys, prefix=True, lease=False)
            messages.append(str(refused.value))
        assert messages[0] == messages[1] and "8" in messages[0]
        assert c.probe_prefix("b/ns", keys) == plain.probe_prefix("b/ns", keys) == (12, True)
