"""A two-minute tour: start a daemon of its own, put and get KV-sized blocks through the arena, show stats.

Run with `make demo` (or `python -m bench.demo`). It leaves nothing behind: the daemon stops at the end.

The get is timed twice, because the first one is not what a serving process sees: its destination buffers
were never touched, so the copy also pays one page fault per 4 KiB page the kernel zero-fills for it (the
put copies into the daemon's pre-faulted arena and pays none). vLLM's KV cache, like any long-lived buffer,
is faulted in once at startup; the warm figure is the median of passes into the same, now-resident buffers.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import numpy as np

from kvstore.testing import DaemonProcess

BLOCK = 2 << 20  # one 16-token block of a 32-layer, 8-KV-head, head_dim-128 bf16 model
N_BLOCKS = 64
PASSES = 5  # timed passes of the put and the warm get (the median is printed)


def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def main(argv: list[str] | None = None) -> None:
    # No options: the parser exists so that `--help` explains the tour instead of running it.
    argparse.ArgumentParser(prog="python -m bench.demo", description=__doc__.split("\n", 1)[0]).parse_args(argv)
    with DaemonProcess(arena_bytes="512MiB", max_block_bytes="4MiB", arena_lock="auto") as d, d.client() as c:
        pid = d.proc.pid if d.proc is not None else "?"  # Optional in its type; set once started
        print(f"daemon pid {pid} on {d.address}; client mode: {c.mode}")
        ns = "demo-model@layout0/default"
        c.register_namespace(ns, model="demo-model", layout_digest="layout0", tenant="default")
        chain = [hashlib.sha256(b"block %d" % i).digest() for i in range(N_BLOCKS)]
        blocks = [np.full(BLOCK, i, dtype=np.uint8) for i in range(N_BLOCKS)]
        total = N_BLOCKS * BLOCK
        puts = []
        for i in range(PASSES):
            if i:
                c.delete(ns, chain)  # so each pass copies every block again (a put of a stored key copies nothing: already_present)
            t = time.perf_counter()
            stored = c.put_many(ns, chain, blocks).stored
            puts.append(time.perf_counter() - t)
            if stored != N_BLOCKS:
                raise SystemExit(f"demo: pass {i} stored {stored} of {N_BLOCKS} blocks")
        put_s = statistics.median(puts)
        print(f"put {N_BLOCKS} x 2 MiB blocks (median of {PASSES}) {put_s * 1e3:.1f} ms ({_gbps(total, put_s)})")
        print(f"prefix lookup of the first 40 + 1 unknown key: {c.lookup_prefix(ns, chain[:40] + [b'unknown'])} hits")
        out = [np.empty(BLOCK, dtype=np.uint8) for _ in range(N_BLOCKS)]
        t = time.perf_counter()
        sizes = c.get_many_into(ns, chain, out)
        cold_s = time.perf_counter() - t
        ok = all(o[0] == i and o[-1] == i for i, o in enumerate(out))
        got = sum(s is not None for s in sizes)
        warm = []
        for _ in range(PASSES):
            for o in out:
                o.fill(0xFF)  # so the check below proves this pass wrote them
            t = time.perf_counter()
            sizes = c.get_many_into(ns, chain, out)
            warm.append(time.perf_counter() - t)
            got = min(got, sum(s is not None for s in sizes))
            ok = ok and all(o[0] == i and o[-1] == i for i, o in enumerate(out))
        warm_s = statistics.median(warm)
        print(f"got {got} blocks, contents verified: {ok}")
        print(f"  cold get (fresh buffers) {cold_s * 1e3:.1f} ms ({_gbps(total, cold_s)}): the first write to "
              "each page of a new buffer faults it in")
        print(f"  warm get (same buffers, median of {PASSES}) {warm_s * 1e3:.1f} ms ({_gbps(total, warm_s)}): "
              "what a serving process with a resident KV cache sees")
        print(f"  get rate / put rate: warm {put_s / warm_s:.2f}, cold {put_s / cold_s:.2f}")
        s = c.stats()
        print(f"stats: {s.blocks} blocks, {s.stored_bytes >> 20} MiB stored of {s.capacity_bytes >> 20} MiB, "
              f"arena locked: {s.arena_locked}, policy: {s.policy}")


if __name__ == "__main__":
    main()
