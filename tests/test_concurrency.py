"""Many client processes at once, each verifying every byte it reads.

Block contents are a pure function of the key (seeded), so any process can verify any block it reads. The
second test sizes the arena well below the working set: eviction, lease expiry races and slot reuse all
happen, and the only acceptable outcomes of a read are a miss or the exact bytes.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import random

import pytest

from kvstore.testing import DaemonProcess

pytestmark = pytest.mark.usefixtures("control_path")  # every test over the fast path and over gRPC

NS = "conc/ns"
SIZES = (4096, 64 << 10, 256 << 10)


def _value(key: bytes) -> bytes:
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    rng = random.Random(seed)
    return rng.randbytes(SIZES[seed % len(SIZES)])


def _worker(address: str, wid: int, n_workers: int, rounds: int, out: mp.Queue) -> None:
    from kvstore import Client

    rng = random.Random(wid)
    counts = {"put": 0, "hit": 0, "miss": 0, "wrong": 0, "bytes": 0}
    with Client(address) as c:
        for r in range(rounds):
            mine = [b"w%d-r%d-%d" % (wid, r, i) for i in range(8)]
            res = c.put_many(NS, mine, [_value(k) for k in mine])
            counts["put"] += res.stored
            other = rng.randrange(n_workers)
            theirs = [b"w%d-r%d-%d" % (other, rng.randrange(max(1, r)), i) for i in range(8)]
            for key, got in zip(mine + theirs, c.get_many(NS, mine + theirs)):
                if got is None:
                    counts["miss"] += 1
                elif got == _value(key):
                    counts["hit"] += 1
                    counts["bytes"] += len(got)
                else:
                    counts["wrong"] += 1
    out.put((wid, counts))


def _run(d: DaemonProcess, n_workers: int, rounds: int) -> list[dict[str, int]]:
    with d.client() as c:
        c.register_namespace(NS)
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(d.address, w, n_workers, rounds, q)) for w in range(n_workers)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return [results[w] for w in range(n_workers)]


def test_eight_processes_roomy_arena_every_read_hits(make_daemon) -> None:
    d = make_daemon(arena_bytes="256MiB", max_block_bytes="1MiB")
    results = _run(d, n_workers=8, rounds=12)
    assert sum(r["wrong"] for r in results) == 0
    assert all(r["put"] == 12 * 8 for r in results)
    # own blocks just written are always there; others' blocks are there unless not written yet (round 0)
    assert all(r["hit"] >= 12 * 8 for r in results)
    with d.client() as c:
        s = c.stats()
        assert s.blocks == 8 * 12 * 8
        assert s.counters["evictions"] == 0
        assert s.reservations_active == 0


@pytest.mark.slow
def test_eight_processes_tight_arena_never_wrong_bytes(make_daemon) -> None:
    d = make_daemon(arena_bytes="24MiB", max_block_bytes="1MiB", lease_ttl_s=0.2, reservation_ttl_s=5)
    results = _run(d, n_workers=8, rounds=25)
    assert sum(r["wrong"] for r in results) == 0
    assert sum(r["hit"] for r in results) > 0
    with d.client() as c:
        s = c.stats()
        assert s.counters["evictions"] > 0
        assert s.allocated_bytes <= s.capacity_bytes
