"""The connector's saves through spare slots (kvstore_connector/saves.py, kvstore/client/slot_bank.py), real daemon.

A part of at most BANKED_KEYS keys is gathered into slots the daemon granted ahead (no request on vLLM's
thread) and stored with one Store on the commit thread, whatever the copy's thread count; a larger part, or spare
slots turned off, reserves and commits. Both must store the same bytes and count the same; these tests check the
requests each makes, exactly.
"""

from __future__ import annotations

import os
import signal

import pytest

from kvstore_connector.namespace import namespace_for
from kvstore_connector import saves
from kvstore_connector.keys import KeyChain, chain_root
from kvstore_connector.plan import SaveJob
from kvstore_connector.saves import BANKED_KEYS
from kvstore.client import Client
from kvstore.fastpath import protocol as fp
from kvstore.testing import DaemonProcess
from tests.connector_helpers import SPEC, T, Req, Side, block_bytes_of, make_caches, prompt_tokens
from tests.fast_helpers import moved

COUNTED = ("reserve_calls", "reserved_blocks", "committed_blocks", "committed_bytes")
KEY_BYTES = 2 * SPEC.block_bytes


@pytest.fixture(scope="module")
def daemon():
    with DaemonProcess(arena_bytes="64MiB", max_block_bytes="4MiB") as d:
        yield d


def _stored(address: str, keys: list[bytes]) -> list[bytes | None]:
    with Client(address) as c:
        return c.get_many(namespace_for(SPEC), keys)


def _keys(req: Req) -> list[bytes]:
    return KeyChain(T, 0, chain_root(0)).extend(req.prompt_token_ids)[:len(req.prompt_token_ids) // T]


@pytest.mark.parametrize("spare_slots", ["1", "0"])
def test_a_save_through_spare_slots_stores_what_reserve_and_commit_store(daemon: DaemonProcess, spare_slots: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_SPARE_SLOTS", spare_slots)
    a = Side(daemon.address, make_caches(21 if spare_slots == "1" else 22), copy_threads=1)
    with Client(daemon.address, control="fast") as probe:
        warm = Req(f"warm{spare_slots}", prompt_tokens(8, start=900 + int(spare_slots)))  # one key: the link
        a.prefill(warm, [60, 61])                  # connects, registers the namespace, the bank gets its slots
        req = Req(f"r{spare_slots}", prompt_tokens(96, start=300 + int(spare_slots)))    # 12 keys, one part
        _, delta = moved(probe, lambda: a.prefill(req, list(range(24))), COUNTED)
    keys = _keys(req)
    assert len(keys) == 12 and 12 <= BANKED_KEYS
    assert _stored(daemon.address, keys) == [block_bytes_of(a.caches, 2 * k) + block_bytes_of(a.caches, 2 * k + 1)
                                             for k in range(12)]
    t = a.worker.counters.totals
    assert (t["saved_blocks"], t["saved_bytes"], t.get("save_skipped_blocks", 0), t.get("save_failures", 0)) == (
        13, 13 * KEY_BYTES, 0, 0)
    # either way one Reserve and one Commit of 12 blocks are counted (a Store counts as both); the requests
    # differ: one Store (the slots were granted during the warm-up), or a Reserve and a Commit
    assert delta == {"reserve_calls": 1, "reserved_blocks": 12, "committed_blocks": 12,
                     "committed_bytes": 12 * KEY_BYTES, "fast_requests": 1 if spare_slots == "1" else 2}
    bank = a.worker.link.client.slot_bank(KEY_BYTES)  # type: ignore[union-attr]
    if spare_slots == "1":
        assert bank is not None and bank.status()["out"] == 0 and bank.status()["pool"] == 64
    else:
        assert bank is None
    a.close()


def test_keys_already_stored_are_counted_skipped_either_way(daemon: DaemonProcess) -> None:
    a = Side(daemon.address, make_caches(23), copy_threads=1)
    req = Req("twice", prompt_tokens(40, start=500))  # 5 keys
    a.prefill(req, list(range(10)))
    again = Req("twice-again", list(req.prompt_token_ids))  # the same keys saved again (no lookup asked)
    a.prefill(again, list(range(10, 20)))
    t = a.worker.counters.totals
    assert (t["saved_blocks"], t["save_skipped_blocks"], t.get("save_failures", 0)) == (5, 5, 0)
    bank = a.worker.link.client.slot_bank(KEY_BYTES)  # type: ignore[union-attr]
    assert bank is not None and bank.status() == {"pool": 64, "out": 0, "epoch": 1}  # the present keys' slots too
    a.close()


def test_a_part_larger_than_banked_keys_reserves(daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(saves, "BANKED_KEYS", 4)
    a = Side(daemon.address, make_caches(24), copy_threads=1)
    with Client(daemon.address, control="fast") as probe:
        a.prefill(Req("warm-big", prompt_tokens(8, start=950)), [62, 63])
        req = Req("big", prompt_tokens(40, start=700))  # 5 keys in one part: more than 4
        _, delta = moved(probe, lambda: a.prefill(req, list(range(10))), ("reserve_calls",))
    assert delta == {"reserve_calls": 1, "fast_requests": 2}  # a Reserve and a Commit
    assert a.worker.counters.totals["saved_blocks"] == 6
    a.close()


def test_a_cpu_copy_on_every_core_saves_through_spare_slots_too(daemon: DaemonProcess) -> None:
    a = Side(daemon.address, make_caches(25), copy_threads=len(os.sched_getaffinity(0)))
    with Client(daemon.address, control="fast") as probe:
        a.prefill(Req("warm-all", prompt_tokens(8, start=970)), [58, 59])
        _, delta = moved(probe, lambda: a.prefill(Req("all", prompt_tokens(40, start=770)), list(range(10))),
                         ("reserve_calls",))
    assert delta == {"reserve_calls": 1, "fast_requests": 1}  # one Store (counted as a Reserve), no Reserve
    assert a.worker.link.client.slot_bank(KEY_BYTES).status() == {"pool": 64, "out": 0, "epoch": 1}  # type: ignore[union-attr]
    a.close()


def test_a_daemon_restart_costs_the_save_in_flight_and_nothing_after(tmp_path) -> None:
    """The save whose spare slots went with the old daemon is lost; the link must not then pause (retry_s) as if
    the store were down: the very next save is stored in the new daemon."""
    d = DaemonProcess(workdir=str(tmp_path), arena_bytes="64MiB", max_block_bytes="4MiB")
    d.start()
    try:
        a = Side(d.address, make_caches(26), copy_threads=1)
        a.prefill(Req("before", prompt_tokens(40, start=310)), list(range(10)))  # 5 keys; the bank holds slots
        d.stop(signal.SIGKILL)
        d.start()
        during = Req("during", prompt_tokens(40, start=410))
        a.prefill(during, list(range(10, 20)))
        after = Req("after", prompt_tokens(40, start=610))
        a.prefill(after, list(range(20, 30)))
        assert _stored(d.address, _keys(after)) == [block_bytes_of(a.caches, 20 + 2 * k)
                                                    + block_bytes_of(a.caches, 21 + 2 * k) for k in range(5)]
        assert _stored(d.address, _keys(during)) == [None] * 5  # those slots were the old daemon's
        t = a.worker.counters.totals
        assert (t["saved_blocks"], t["save_failures"]) == (10, 1)
        a.close()
    finally:
        d.close()


def test_a_step_is_one_part_unless_a_block_is_missing_or_it_is_too_long(daemon: DaemonProcess,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The usual step (one group, every block there, within max_batch_keys) is saved as the job itself; a missing
    block drops its key, and a job past max_batch_keys is cut, in order."""
    a = Side(daemon.address, make_caches(23), copy_threads=1)
    a.prefill(Req("warm-parts", prompt_tokens(8, start=950)), [62, 63])  # connected: max_batch_keys known
    keys = [bytes([i]) * 16 for i in range(4)]
    job = SaveJob("r", None, keys, [[0, 1, 2, 3, 4, 5, 6, 7]])  # two vLLM blocks a key
    parts = a.worker._parts(job)
    assert parts == [(0, job)] and parts[0][1] is job
    gap = SaveJob("r", None, keys, [[0, 1, -1, 3, 4, 5, 6, 7]])
    assert a.worker._parts(gap) == [(0, SaveJob("r", None, [keys[0], keys[2], keys[3]], [[0, 1, 4, 5, 6, 7]]))]
    monkeypatch.setattr(a.worker, "_batch_keys", lambda: 3)
    assert a.worker._parts(job) == [(0, SaveJob("r", None, keys[:3], [[0, 1, 2, 3, 4, 5]])),
                                    (0, SaveJob("r", None, keys[3:], [[6, 7]]))]
    a.close()


def test_the_commit_thread_never_polls_for_its_replies(daemon: DaemonProcess) -> None:
    """Its Stores run while vLLM's thread copies the next step on every core (fast_channel.quiet_thread)."""
    a = Side(daemon.address, make_caches(24), copy_threads=1)
    a.prefill(Req("warm-quiet", prompt_tokens(8, start=960)), [62, 63])
    c = a.worker.link.client
    assert c is not None and c.control_path == "fast"
    channel = c._control.channel  # type: ignore[attr-defined]

    def spin_after_a_call() -> float:
        channel.call(fp.ECHO, b"")
        return channel.conn().reader.spin_s
    assert channel.spin_us > 0 and spin_after_a_call() == channel.spin_us * 1e-6  # this thread polls
    assert a.worker._committer.submit(spin_after_a_call).result() == 0.0
    a.close()
