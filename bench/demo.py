"""A two-minute tour: start a daemon of its own, put and get KV-sized blocks through the arena, show stats.

Run with `make demo` (or `python -m bench.demo`). It leaves nothing behind: the daemon stops at the end.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np

from kvstore.testing import DaemonProcess

BLOCK = 2 << 20  # one 16-token block of a 32-layer, 8-KV-head, head_dim-128 bf16 model


def main() -> None:
    with DaemonProcess(arena_bytes="512MiB", max_block_bytes="4MiB", arena_lock="auto") as d, d.client() as c:
        print(f"daemon pid {d.proc.pid} on {d.address}; client mode: {c.mode}")
        ns = "demo-model@layout0/default"
        c.register_namespace(ns, model="demo-model", layout_digest="layout0", tenant="default")
        chain = [hashlib.sha256(b"block %d" % i).digest() for i in range(64)]
        blocks = [np.full(BLOCK, i, dtype=np.uint8) for i in range(64)]
        t = time.perf_counter()
        stored = c.put_many(ns, chain, blocks).stored
        dt = time.perf_counter() - t
        print(f"put {stored} x 2 MiB blocks in {dt * 1e3:.1f} ms ({stored * BLOCK / dt / 1e9:.2f} GB/s)")
        print(f"prefix lookup of the first 40 + 1 unknown key: {c.lookup_prefix(ns, chain[:40] + [b'unknown'])} hits")
        out = [np.empty(BLOCK, dtype=np.uint8) for _ in range(64)]
        t = time.perf_counter()
        sizes = c.get_many_into(ns, chain, out)
        dt = time.perf_counter() - t
        ok = all(o[0] == i and o[-1] == i for i, o in enumerate(out))
        print(f"got {sum(s is not None for s in sizes)} blocks in {dt * 1e3:.1f} ms "
              f"({64 * BLOCK / dt / 1e9:.2f} GB/s), contents verified: {ok}")
        s = c.stats()
        print(f"stats: {s.blocks} blocks, {s.stored_bytes >> 20} MiB stored of {s.capacity_bytes >> 20} MiB, "
              f"arena locked: {s.arena_locked}, policy: {s.policy}")


if __name__ == "__main__":
    main()
