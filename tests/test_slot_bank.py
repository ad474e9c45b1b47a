"""Spare slots taken on one thread and stored on another (kvstore/client/slot_bank.py), against a real daemon.

The bank is what the connector's saves use: vLLM's thread takes slots (no request) and gathers into them, the
commit thread stores them. These tests try to make a slot be copied into twice or after it was freed: a take
while slots are out must never ask for a new set (that frees them), a refused Store keeps its slots out until
given back, a daemon restarted under the bank leaves none of the old slots usable.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import Client, arena_path
from kvstore.client.slot_bank import SlotBank, Taken
from kvstore.errors import KVStoreError, StoreUnavailableError
from kvstore.testing import DaemonProcess
from kvstore.vocab import ReserveOutcome
from tests.fast_helpers import keyset, moved

KiB = 1 << 10
SIZE = 64 * KiB
RESERVED, PRESENT = int(ReserveOutcome.RESERVED), int(ReserveOutcome.ALREADY_PRESENT)


@pytest.fixture(scope="module")
def daemon():
    with DaemonProcess(arena_bytes="256MiB") as d:  # spare slots may take 32 MiB: 8 grants of 64 x 64 KiB
        yield d


def _copy(c: Client, taken: Taken, values: list[np.ndarray]) -> None:
    m = c.acquire_arena(taken.incarnation)
    assert m is not None
    with m:
        arena_path.write_slots(m, taken.offsets, values)


def _bank(c: Client) -> SlotBank:
    bank = c.slot_bank(SIZE)
    assert bank is not None and c.slot_bank(SIZE) is bank  # one bank per block size
    return bank


def test_slots_taken_on_one_thread_are_stored_on_another(daemon: DaemonProcess) -> None:
    keys = keyset("bank", 8)
    values = [np.full(SIZE, 30 + i, np.uint8) for i in range(8)]
    with Client(daemon.address, control="fast") as c:
        c.register_namespace("bank/a")
        bank = _bank(c)
        taken, delta = moved(c, lambda: bank.take(8), ())
        assert taken is not None and len(set(taken.offsets)) == 8 and delta == {"fast_requests": 1}  # Spare
        assert bank.status() == {"pool": 56, "out": 8, "epoch": 1}
        _copy(c, taken, values)
        got: list[object] = []
        t = threading.Thread(target=lambda: got.append(bank.store("bank/a", keys, taken)))  # the commit thread
        t.start()
        t.join(10)
        assert got == [([RESERVED] * 8, 8)]
        assert bank.status() == {"pool": 64, "out": 0, "epoch": 1}  # 8 new slots came with the Store's reply
        assert c.get_many("bank/a", keys) == [v.tobytes() for v in values]
        # a take served from the pool asks nothing; a key already present keeps its slot in the bank
        again, delta = moved(c, lambda: bank.take(2), ())
        assert again is not None and delta == {"fast_requests": 0}
        _copy(c, again, [np.zeros(SIZE, np.uint8)] * 2)
        assert bank.store("bank/a", [keys[0], b"new-one"], again) == ([PRESENT, RESERVED], 1)
        assert bank.status() == {"pool": 64, "out": 0, "epoch": 1}
        assert c.get_many("bank/a", [keys[0], b"new-one"]) == [values[0].tobytes(), bytes(SIZE)]


def test_a_take_never_asks_for_new_slots_while_some_are_out(daemon: DaemonProcess) -> None:
    with Client(daemon.address, control="fast") as c:
        c.register_namespace("bank/b")
        bank = _bank(c)
        first = bank.take(40)
        assert first is not None
        # 24 left: a second take of 40 would need a new set, which frees the 40 being copied into: refused
        second, delta = moved(c, lambda: bank.take(40), ())
        assert second is None and delta == {"fast_requests": 0}
        assert bank.take(65) is None  # more than one grant holds: reserve
        assert bank.status() == {"pool": 24, "out": 40, "epoch": 1}
        bank.give_back(first)
        assert bank.status() == {"pool": 64, "out": 0, "epoch": 1}


def test_a_refused_store_keeps_its_slots_out_until_given_back(daemon: DaemonProcess) -> None:
    with Client(daemon.address, control="fast") as c:
        bank = _bank(c)
        taken = bank.take(3)
        assert taken is not None
        with pytest.raises(KVStoreError, match="bank/never-registered"):
            bank.store("bank/never-registered", keyset("refused", 3), taken)
        assert bank.status()["out"] == 3  # the caller may register the namespace and store them again
        c.register_namespace("bank/c")
        keys = keyset("refused", 3)
        _copy(c, taken, [np.full(SIZE, 9, np.uint8)] * 3)
        assert bank.store("bank/c", keys, taken) == ([RESERVED] * 3, 3)
        assert bank.status() == {"pool": 64, "out": 0, "epoch": 1}
        assert c.get_many("bank/c", keys) == [bytes([9]) * SIZE] * 3


def test_a_daemon_restarted_under_the_bank_leaves_no_old_slot_usable(tmp_path: Path) -> None:
    d = DaemonProcess(workdir=str(tmp_path), arena_bytes="64MiB")
    d.start()
    try:
        with Client(d.address, control="fast") as c:
            c.register_namespace("bank/r")
            bank = _bank(c)
            taken = bank.take(4)
            assert taken is not None
            d.stop(signal.SIGKILL)
            d.start()
            c.register_namespace("bank/r")
            with pytest.raises(StoreUnavailableError):
                bank.store("bank/r", keyset("restart", 4), taken)  # the slots went with the old daemon
            bank.give_back(taken)                                   # of an old epoch: ignored
            assert bank.status() == {"pool": 0, "out": 0, "epoch": 2}
            # the bank's next set comes from the new daemon, whose arena the client must map first: it
            # reconnects to do so, closing this bank with its channel; the next bank is the new connection's
            assert bank.take(4) is None
            assert c.arena_incarnation != taken.incarnation
            bank = _bank(c)
            fresh = bank.take(4)
            assert fresh is not None and fresh.incarnation == c.arena_incarnation
            _copy(c, fresh, [np.full(SIZE, 4, np.uint8)] * 4)
            keys = keyset("restart", 4)
            assert bank.store("bank/r", keys, fresh) == ([RESERVED] * 4, 4)
            assert c.get_many("bank/r", keys) == [bytes([4]) * SIZE] * 4
    finally:
        d.close()


def test_no_bank_over_grpc_or_with_spare_slots_off(daemon: DaemonProcess) -> None:
    with Client(daemon.address, control="grpc") as g, Client(daemon.address, control="fast", spare_slots=False) as f:
        assert g.slot_bank(SIZE) is None and f.slot_bank(SIZE) is None
