"""DiskStore's crash safety and concurrency: a child writing a storm is SIGKILLed and the reopened store never
serves a torn block; reads racing reclamation are misses, never wrong bytes; close waits for reads in flight
(GatedIO holds one inside its pread).
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import xxhash

from kvstore.testing.gated_io import GatedIO
from kvstore.tiers.disk import DiskConfig, DiskStatus, DiskStore
from tests.disk_store_helpers import NOT_FOUND, OK, Buf, KiB, MiB, cfg, random_bytes, read, write


# ------------------------------------------------------------------------------------------- crash safety
CONTENT_SRC = '''
import numpy as np, xxhash
def content(key):
    h = xxhash.xxh64_intdigest(key)
    n = 1 + h % (200 << 10)
    rng = np.random.default_rng(h)
    if h % 3 == 0:
        return rng.bytes(n)
    return (rng.integers(0, 16, n, dtype=np.uint8) * 3).tobytes()
def codec_for(key):
    return ("none", "zstd", "zstd-shuffle2")[xxhash.xxh64_intdigest(key, seed=1) % 3]
'''
_ns: dict = {}
exec(CONTENT_SRC, _ns)
content, codec_for = _ns["content"], _ns["codec_for"]

CHILD = CONTENT_SRC + '''
import mmap, sys
from kvstore.tiers.disk import DiskConfig, DiskStore, WriteItem
directory, rnd = sys.argv[1], int(sys.argv[2])
store = DiskStore(DiskConfig(directory, capacity_bytes=6 << 20, segment_bytes=1 << 20, sync="data"))
store.open()
mm = mmap.mmap(-1, 8 * (256 << 10))
arr = np.frombuffer(mm, dtype=np.uint8)
print("ready", flush=True)
i = batch = 0
while True:
    n = 1 + batch % 6
    keys = [b"r%d-%d" % (rnd, i + j) for j in range(n)]
    if batch % 5 == 4:
        keys.append(b"r%d-%d" % (rnd, i // 2))      # replace an earlier key (same bytes)
    i += n
    batch += 1
    items = []
    for j, key in enumerate(keys):
        data = content(key)
        off = j * (256 << 10)
        arr[off:off + len(data)] = np.frombuffer(data, dtype=np.uint8)
        items.append(WriteItem("crash", key, arr.ctypes.data + off, len(data), codec_for(key)))
    store.write_many(items)
'''


def test_sigkill_during_write_storm_never_serves_torn_blocks(tmp_path: Path) -> None:
    directory = tmp_path / "crash"
    rng = random.Random(11)
    for rnd in range(3):
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(directory), str(rnd)], stdout=subprocess.PIPE)
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.3, 1.2))
        child.send_signal(signal.SIGKILL)
        child.wait()
        s = DiskStore(DiskConfig(str(directory), capacity_bytes=6 << 20, segment_bytes=1 << 20, sync="data"))
        s.open()
        seen, cursor = [], b""
        while True:
            records, cursor = s.list_keys("crash", cursor, 100)
            seen += records
            if not cursor:
                break
        assert any(r.key.startswith(b"r%d-" % rnd) for r in seen), "the child committed nothing"
        out = Buf(256 * KiB)
        for rec in seen:
            status, n = s.read_into("crash", rec.key, out.address, out.size)
            assert status is OK, (rnd, rec)
            assert out.get(n) == content(rec.key), (rnd, rec)
        assert s.stats().checksum_failures == 0
        s.close()


# ------------------------------------------------------------------------------------------- concurrency
def test_reads_racing_reclamation_are_misses_never_wrong_bytes(tmp_path: Path) -> None:
    # 3 segments of 1 MiB, 64 KiB blocks: a segment is reclaimed every 16 writes while readers read.
    s = DiskStore(cfg(tmp_path / "d"))
    s.open()
    blk = 64 * KiB
    written: list[bytes] = []
    stop = threading.Event()
    bad: list[object] = []
    counts = {"ok": 0, "miss": 0}

    def data_of(key: bytes) -> bytes:
        return random_bytes(blk, xxhash.xxh64_intdigest(key))

    def writer() -> None:
        buf = Buf(4 * blk)
        i = 0
        while not stop.is_set():
            batch = {f"w{i + j}".encode(): b"" for j in range(4)}
            for key in batch:
                batch[key] = data_of(key)
            if write(s, buf, "ns", batch) != [OK] * 4:
                bad.append(("write", i))
            written.extend(batch)
            i += 4

    def reader(seed: int) -> None:
        rnd = random.Random(seed)
        out = Buf(blk)
        while not stop.is_set():
            if len(written) < 8:
                continue
            key = written[rnd.randrange(max(0, len(written) - 60), len(written))]
            status, n = s.read_into("ns", key, out.address, out.size)
            if status is OK:
                counts["ok"] += 1
                if out.get(n) != data_of(key):
                    bad.append(("bytes", key))
            elif status is NOT_FOUND:
                counts["miss"] += 1
            else:
                bad.append((status, key))

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join()
    st = s.stats()
    s.close()
    assert not bad, bad[:5]
    assert counts["ok"] > 50 and st.evicted_blocks > 0 and st.checksum_failures == 0


@pytest.mark.parametrize("corrupt", [False, True])
def test_close_waits_for_in_flight_reads(tmp_path: Path, corrupt: bool) -> None:
    io = GatedIO()
    s = DiskStore(cfg(tmp_path / "d"), io=io)
    s.open()
    data = random_bytes(64 * KiB, 1)
    assert write(s, Buf(MiB), "ns", {b"k": data}) == [OK]
    if corrupt:   # the read then drops the entry, which needs the index: close must not hold it while waiting
        rec = s.lookup("ns", b"k")
        assert rec is not None
        with open(s.segment_path(rec.segment), "r+b") as f:
            f.seek(rec.offset)
            f.write(b"\0" * 16)
    io.armed = "pread"
    result: list[tuple[DiskStatus, bytes]] = []
    reader = threading.Thread(target=lambda: result.append(read(s, "ns", b"k")))
    reader.start()
    assert io.entered.wait(10)                 # the read is inside its pread
    closer = threading.Thread(target=s.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()                   # close waits for the read in flight
    io.gate.set()
    reader.join(10)
    closer.join(10)
    assert not closer.is_alive() and not reader.is_alive()
    assert result == [(DiskStatus.CHECKSUM_ERROR, b"")] if corrupt else result == [(OK, data)]
    assert read(s, "ns", b"k")[0] is NOT_FOUND   # a closed store answers reads with a miss
