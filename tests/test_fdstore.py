"""systemd's file descriptor store: a daemon killed with -9 (or stopped and started) by systemd serves the RAM
blocks that verify; damaged headers and bytes are dropped and counted; another format starts cold, saying why.

systemd is played by kvstore/testing/systemd.py (its two protocols, real sockets and descriptors); the daemons
are real processes. The test holds what systemd holds (the journal and the arena files), which also makes it
the adversary of the corruption test: it damages them between two daemons.
"""

from __future__ import annotations

import mmap
import os
import signal

import pytest

from kvstore.arena.journal import RamJournal, record_hash
from kvstore.arena.layout import ArenaLayout
from kvstore.server.handover.fdstore import JOURNAL_NAME, arena_name
from kvstore.testing import DaemonProcess, wait_until
from kvstore.testing.systemd import FakeSystemd

NS = "m@1/fdstore"
BLOCK = 32 * 1024
N = 30


def _values() -> tuple[list[bytes], list[bytes]]:
    return [b"f-%03d" % i for i in range(N)], [bytes([i + 1]) * BLOCK for i in range(N)]


def _daemon(sd: FakeSystemd) -> DaemonProcess:
    """A RAM-only daemon under the played systemd: only the fd store can bring its blocks back."""
    d = DaemonProcess(arena_bytes="32MiB", max_block_bytes="1MiB", env=sd.env)
    return d.start(launcher=sd.launch)


def _layout(d: DaemonProcess) -> ArenaLayout:
    return ArenaLayout.for_capacity(d.arena_name.lstrip("/"), 32 << 20, 1 << 20)  # the daemon's options


def _journal(sd: FakeSystemd, layout: ArenaLayout) -> RamJournal:
    return RamJournal.open(os.dup(sd.stored()[JOURNAL_NAME]), layout)


def _stored_and_hashed(d: DaemonProcess, sd: FakeSystemd) -> tuple[list[bytes], list[bytes], ArenaLayout]:
    keys, values = _values()
    with d.client() as c:
        c.register_namespace(NS)
        assert c.put_many(NS, keys, values).stored == N  # committed without checksums (arena puts)
    wait_until(lambda: sd.said("READY=1") == 1 and {JOURNAL_NAME, arena_name(0)} <= set(sd.stored()), 20,
               what="the files in the store")
    layout = _layout(d)

    def hashed() -> bool:
        j = _journal(sd, layout)
        try:
            rec = j.scan().records
            return len(rec) == N and bool((rec["checksum"] != 0).all())
        finally:
            j.close()
    wait_until(hashed, 30, what="every block's record written and hashed (the journal thread, under the store)")
    return keys, values, layout


def _next(d: DaemonProcess, sd: FakeSystemd) -> DaemonProcess:
    """systemd's next instance of the service: the same options, the stored descriptors passed."""
    d.stop(signal.SIGKILL)
    n = DaemonProcess.__new__(DaemonProcess)
    n.__dict__.update(d.__dict__)
    n._tmp = None
    n.log_path = d.log_path + ".next"
    return n.start(launcher=sd.launch)


def test_kill_9_under_systemd_keeps_every_ram_block_that_verifies() -> None:
    with FakeSystemd() as sd:
        d = _daemon(sd)
        try:
            keys, values, _ = _stored_and_hashed(d, sd)
            n = _next(d, sd)
            with n.client() as c:
                assert c.get_many(NS, keys) == values
                assert c.probe_prefix(NS, keys) == (N, True)  # from RAM: there is no disk tier
            assert f"RAM tier kept from the fd store: {N} blocks" in n.log()
            assert "dropped: none" in n.log()
            # the new daemon stored its own files again, under the same names
            assert {JOURNAL_NAME, arena_name(0)} <= set(sd.stored())
            n.stop()
        finally:
            d.close()


def test_damaged_headers_and_bytes_are_dropped_and_counted_never_served() -> None:
    with FakeSystemd() as sd:
        d = _daemon(sd)
        try:
            keys, values, layout = _stored_and_hashed(d, sd)
            d.stop(signal.SIGKILL)
            j = _journal(sd, layout)
            scan = j.scan()
            by_key = dict(zip(scan.keys(), scan.eids.tolist()))
            j.entries["key"][by_key[keys[0]], 1] ^= 0x40                # a header damaged: its hash fails
            e = by_key[keys[1]]                                          # a header rewritten with another size,
            rec = j.entries[e: e + 1].copy()                             # its hash made valid again
            rec["size"] = BLOCK - 4096
            rec["hash"] = record_hash(rec)
            j.entries[e] = rec[0]
            off = int(scan.records["offset"][scan.eids.tolist().index(by_key[keys[2]])])
            j.close()
            arena_fd = sd.stored()[arena_name(0)]
            with mmap.mmap(arena_fd, layout.size_bytes) as m:               # a block's bytes changed
                m[off + 7] ^= 0xFF
            n = _next(d, sd)
            with n.client() as c:
                got = c.get_many(NS, keys)
                counters = c.stats().counters
            assert got[:3] == [None, None, None]                          # misses, never other bytes
            assert (counters["restart_adopted_blocks"], counters["restart_dropped_header"],
                    counters["restart_dropped_checksum"]) == (N - 3, 1, 2)
            assert got[3:] == values[3:]
            log = n.log()
            assert f"RAM tier kept from the fd store: {N - 3} blocks" in log
            assert "dropped: checksum 2, header 1" in log
            n.stop()
        finally:
            d.close()


def test_a_journal_of_another_format_starts_cold_and_says_why() -> None:
    with FakeSystemd() as sd:
        d = _daemon(sd)
        try:
            keys, _, _ = _stored_and_hashed(d, sd)
            d.stop(signal.SIGKILL)
            os.pwrite(sd.stored()[JOURNAL_NAME], (7).to_bytes(4, "little"), 8)  # the format word
            old_arena = os.fstat(sd.stored()[arena_name(0)]).st_ino
            n = _next(d, sd)
            with n.client() as c:
                c.register_namespace(NS)  # cold, RAM only: the namespace too is gone
                assert c.get_many(NS, keys) == [None] * N
            assert "starting cold" in n.log() and "journal format 7" in n.log()
            # the old files left the store (their memory goes), the new daemon's are there
            assert os.fstat(sd.stored()[arena_name(0)]).st_ino != old_arena
            n.stop()
        finally:
            d.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_a_clean_stop_and_start_by_systemd_keeps_every_block(sig: int) -> None:
    # a clean stop hashes what the journal thread had not hashed yet: nothing is left unchecked
    with FakeSystemd() as sd:
        d = _daemon(sd)
        try:
            keys, values = _values()
            with d.client() as c:
                c.register_namespace(NS)
                assert c.put_many(NS, keys, values).stored == N
            d.stop(sig)
            assert sd.said("STOPPING=1") == 1
            n = DaemonProcess.__new__(DaemonProcess)
            n.__dict__.update(d.__dict__)
            n._tmp = None
            n.log_path = d.log_path + ".next"
            n.start(launcher=sd.launch)
            with n.client() as c:
                assert c.get_many(NS, keys) == values
            assert f"RAM tier kept from the fd store: {N} blocks" in n.log()
            n.stop()
        finally:
            d.close()
