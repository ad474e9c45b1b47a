"""Copies racing remaps, run as its own process so a segfault is an exit code, not a dead test runner.

`client` mode: reader threads copy blocks out with get_many_into while another thread keeps replacing the
client's arena mapping (what a daemon restart does), then closes the client under them.
`connector` mode: the vLLM connector's worker side saves and loads CPU "KV" in a loop while the test kills the
daemon with -9 and restarts it; every load must be exactly the saved bytes or reported as failed.
Prints one JSON object with the counts; exit 0 when nothing was wrong, 3 when a wrong byte was seen.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np

from kvstore.client import Client
from kvstore.errors import KVStoreError

BLOCK = 256 * 1024


def _value(i: int) -> bytes:
    return bytes([i % 251]) * 64 + np.random.default_rng(i).bytes(BLOCK - 64)


def client_mode(address: str, seconds: float) -> dict[str, int]:
    c = Client(address)
    c.register_namespace("remap")
    keys = [b"k%d" % i for i in range(16)]
    values = [_value(i) for i in range(16)]
    assert c.put_many("remap", keys, values).stored == 16
    counts = {"reads": 0, "exact": 0, "misses": 0, "wrong": 0, "errors": 0, "remaps": 0}
    lock = threading.Lock()
    stop = threading.Event()

    def reader() -> None:
        bufs = [bytearray(BLOCK) for _ in keys]
        while not stop.is_set():
            try:
                got = c.get_many_into("remap", keys, bufs)
            except (KVStoreError, ValueError):  # ValueError: grpc's "closed channel" after close()
                with lock:
                    counts["errors"] += 1
                continue
            with lock:
                for n, buf, want in zip(got, bufs, values):
                    counts["reads"] += 1
                    if n is None:
                        counts["misses"] += 1
                    elif bytes(buf) == want:
                        counts["exact"] += 1
                    else:
                        counts["wrong"] += 1

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        c._connect()  # noqa: SLF001 - exactly what a new daemon incarnation triggers
        counts["remaps"] += 1
    c.close()  # under the readers, as the connector's link does when the store goes down
    time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join()
    return counts


def connector_mode(address: str, seconds: float, stop_file: str = "") -> dict[str, int]:
    import torch  # noqa: PLC0415

    from kvstore_connector.config import ConnectorConfig
    from kvstore_connector.link import StoreLink
    from kvstore_connector.namespace import KVLayoutSpec, registration
    from kvstore_connector.plan import LoadJob, SaveJob
    from kvstore_connector.worker import WorkerSide

    spec = KVLayoutSpec(model="org/stress", dtype="float16", block_size=16, num_layers=4, num_kv_heads=4,
                        head_dim=64, tp_rank=0, tp_size=1, blocks_per_key=1)
    nblocks, n = 64, 16
    g = torch.Generator().manual_seed(7)
    caches = {f"layers.{i}.attn": torch.randn(2, nblocks, 16, 4, 64, generator=g).to(torch.float16) for i in range(4)}
    config = ConnectorConfig.from_extra({"address": address, "blocks_per_key": 1, "load_timeout_s": 2.0})
    link = StoreLink(address, timeout_s=2.0, retry_s=0.05, namespace_spec=lambda _n: registration(spec))
    w = WorkerSide(config, spec, link)
    w.register(caches, nblocks)
    keys = [b"stress-%02d" % i for i in range(n)]
    src, dst = list(range(n)), list(range(32, 32 + n))

    def block_bytes(b: int) -> bytes:
        return b"".join(t[kv, b].numpy().tobytes() for t in caches.values() for kv in range(2))

    want = [block_bytes(b) for b in src]
    counts = {"iterations": 0, "loads_ok": 0, "loads_failed": 0, "wrong": 0, "ok_streak_at_end": 0}
    deadline = time.monotonic() + seconds
    it = 0
    while time.monotonic() < deadline and not (stop_file and os.path.exists(stop_file)):
        it += 1
        w.save([SaveJob(f"s{it}", None, keys, [src])])
        for t in caches.values():
            t[:, 32:32 + n].zero_()
        w.start_loads([LoadJob(f"l{it}", None, keys, [dst])])
        w.drain()
        _, recv = w.finished(set())
        assert recv == {f"l{it}"}, recv
        failed = w.load_errors()
        if failed:
            assert failed == set(dst), failed
            counts["loads_failed"] += 1
            counts["ok_streak_at_end"] = 0
            time.sleep(0.01)  # a vLLM step's pace while the store is down (the link answers at once)
        elif [block_bytes(b) for b in dst] == want:
            counts["loads_ok"] += 1
            counts["ok_streak_at_end"] += 1
        else:
            counts["wrong"] += 1
        counts["iterations"] += 1
    w.close()
    link.close()
    return counts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["client", "connector"])
    ap.add_argument("address")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--stop-file", default="", help="connector mode: stop when this file appears (or at --seconds)")
    args = ap.parse_args()
    counts = (client_mode(args.address, args.seconds) if args.mode == "client"
              else connector_mode(args.address, args.seconds, args.stop_file))
    print(json.dumps(counts), flush=True)
    return 3 if counts["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
