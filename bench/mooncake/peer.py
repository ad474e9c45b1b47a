"""One Mooncake Store process for bench.remote's comparison, driven line by line over stdin/stdout.

Runs under the Mooncake venv's Python (bench/mooncake/setup_venv.sh), inside the network namespace that
bench/mooncake/rig.py made, and imports nothing of kvstore. Two roles:

    holder   mounts a segment that holds the blocks and puts BATCH blocks of BLOCK bytes there (one
             batch_put_from of a registered buffer, every byte pseudo-random from a seed); then serves reads
    getter   mounts no segment (so every block it reads lives in the holder's memory, behind the TCP
             transport) and registers one destination buffer of BATCH x BLOCK bytes, the same kind of memory
             as kvstore's arena (a memfd mapped shared)

Commands (one line each; every answer is one line, "ok ..." or "error ..."):
    get      getter: one batch_get_into of every key into the registered buffer; answers "ok <seconds>",
             timed around that call alone (no pipe in it: the most favourable reading of Mooncake)
    check    getter: answers "ok <xxh3 of each block, hex, comma-separated>" of the buffer as it is now
    quit     both: close the store and exit

Why a buffer of the arena's kind and one batched call: that is what kvstore's remote get does (32 blocks into
arena slots in one call per peer), so both products move the same bytes between the same kind of memory.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time

import numpy as np
import xxhash


def _shared(nbytes: int) -> np.ndarray:
    fd = os.memfd_create("bench-mooncake", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        buf = np.frombuffer(mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), dtype=np.uint8)
    finally:
        os.close(fd)
    buf[:] = 0  # pre-faulted
    return buf


def _digest(view: np.ndarray) -> str:
    return format(xxhash.xxh3_64_intdigest(memoryview(view)), "x")  # type: ignore[arg-type]  # numpy's stubs: no Buffer


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("role", choices=["holder", "getter"])
    ap.add_argument("--host", required=True, help="this process's address in the namespace")
    ap.add_argument("--metadata", required=True, help="the master's HTTP metadata URL")
    ap.add_argument("--master", required=True, help="the master's RPC address")
    ap.add_argument("--block", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig  # type: ignore[import-not-found]  # its venv's

    total = args.block * args.batch
    keys = [f"bench-remote-{i}" for i in range(args.batch)]
    store = MooncakeDistributedStore()
    segment = total + (64 << 20) if args.role == "holder" else 0
    rc = store.setup(args.host, args.metadata, segment, 64 << 20, "tcp", "", args.master)
    if rc != 0:
        _say(f"error setup returned {rc}")
        return 1
    buf = _shared(total)
    rc = store.register_buffer(buf.ctypes.data, total)
    if rc != 0:
        _say(f"error register_buffer returned {rc}")
        return 1
    ptrs = [buf.ctypes.data + i * args.block for i in range(args.batch)]
    sizes = [args.block] * args.batch
    if args.role == "holder":
        buf[:] = np.random.default_rng(args.seed).integers(0, 256, total, dtype=np.uint8)
        config = ReplicateConfig()
        config.replica_num = 1
        config.preferred_segment = store.get_hostname()
        put = store.batch_put_from(keys, ptrs, sizes, config)
        if any(r != 0 for r in put):
            _say(f"error batch_put_from returned {put}")
            return 1
        _say("ok " + ",".join(_digest(buf[i * args.block: (i + 1) * args.block]) for i in range(args.batch)))
    else:
        _say("ok ready")
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "get" and args.role == "getter":
            t0 = time.perf_counter()
            got = store.batch_get_into(keys, ptrs, sizes)
            dt = time.perf_counter() - t0
            if list(got) != sizes:
                _say(f"error batch_get_into returned {list(got)}")
                continue
            _say(f"ok {dt!r}")
        elif cmd == "check" and args.role == "getter":
            _say("ok " + ",".join(_digest(buf[i * args.block: (i + 1) * args.block]) for i in range(args.batch)))
        elif cmd == "quit":
            break
        else:
            _say(f"error unknown command {cmd!r} for a {args.role}")
    store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
