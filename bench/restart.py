"""Restarting a loaded daemon three ways: cold, today's restart (the disk tier warm), a hand-over (issue 40).

    python -m bench.restart [--quick] [--arena 1GiB] [--block 1MiB] [--no-vllm]

A daemon's RAM is filled (80 % of the arena: below the eviction watermark with spare slots held) with a disk tier behind it holding
every block; then it is restarted:

    cold       SIGTERM, start again with the disk tier wiped: what a node without kvstore's tiers keeps (nothing)
    disk-warm  SIGTERM, start again: today's restart; the disk tier comes back, RAM is empty
    hand-over  `kvstore-server --take-over` started beside it: the arena, catalog and sockets move over

and a client (the connector's path: a persistent arena-mode Client, fast path) keeps asking for one block the
whole time. Measured per way, from the moment the restart is started:

    unavailable_s    the longest stretch without any answer (a hit or a miss) from the socket: the outage
    first_hit_s      from the outage's start to the first answer after it that is the stored block
    ram_kept         the fraction of the blocks in RAM before that are in RAM after (the Lookup's tier)
    hits_kept        the fraction served at all (RAM or disk)

The limits, measured in the same run on the same bytes: nothing between the answers (unavailable 0, kept 1.0)
is the hand-over's; what moving the RAM any other way costs is a memcpy of it (a copying hand-over) or an
O_DIRECT read of it from the same disk (the fastest possible disk-warm refill); the raw mechanism of the
hand-over is a process passing the memfd over a unix socket and the receiver mapping and hashing it. Then,
unless --no-vllm, the load's TTFT through a real vLLM server (bench.serve's model) across each restart
(bench/restart_vllm.py). Prints tables and one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import xxhash

from bench._common import fmt_bytes, gbs, print_table
from bench.targets import Target, evaluate, mark
from kvstore import Client
from kvstore.errors import KVStoreError, StoreUnavailableError
from kvstore.server.config.units import parse_size
from kvstore.testing import DaemonProcess, wait_until
from kvstore.vocab import Tier

NS = "bench@1/restart"
MODES = ("cold", "disk-warm", "hand-over")
FILL = 0.8  # of the arena: below the eviction watermark (0.95) with the connections' spare slots (<= 1/8)
TARGETS = (Target("handover_ram_kept", ">=", 0.99, "issue 40"),
           Target("handover_unavailable_s", "<=", 1.0, "issue 40"))


@dataclass
class Outcome:
    mode: str
    unavailable_s: float
    first_hit_s: float | None
    ram_kept: float
    hits_kept: float
    probes: int
    probe_interval_s: float  # the prober's median interval while serving: the resolution of unavailable_s
    restart_s: float         # from the start of the restart until the new process answers
    extra: dict[str, Any] = field(default_factory=dict)


class Prober:
    """Asks for one block in a loop (get: a fast-path round trip or a read from the shared key index), noting
    each answer's time and whether it was the block."""

    def __init__(self, address: str, key: bytes, value: bytes) -> None:
        self._address, self._key, self._value = address, key, value
        self.answers: list[tuple[float, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        c: Client | None = None
        while not self._stop.is_set():
            try:
                if c is None:
                    c = Client(self._address, timeout_s=2.0)
                got = c.exists(NS, [self._key])[0] and c.get(NS, self._key) == self._value
                self.answers.append((time.monotonic(), bool(got)))
            except StoreUnavailableError:  # no answer: the socket refused, or the call broke
                if c is not None:
                    c.close()
                    c = None
                time.sleep(0.002)
            except KVStoreError:  # an answer, and a miss (a cold daemon knows no namespace)
                self.answers.append((time.monotonic(), False))
            time.sleep(0.001)
        if c is not None:
            c.close()

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def result(self, t0: float) -> tuple[float, float | None, float]:
        """(the longest gap between answers from t0 on: the outage; seconds from the outage's start to the first
        hit after it: the new daemon's first hit; the median interval between answers before t0)."""
        times = [t for t, _ in self.answers]
        before = [b - a for a, b in zip(times, times[1:]) if b < t0]
        after = [t for t in times if t >= t0]
        last_before = max((t for t in times if t < t0), default=t0)
        edges = list(zip([last_before] + after, after))
        if not edges:
            return float("inf"), None, 0.0
        start, end = max(edges, key=lambda e: e[1] - e[0])
        hit = next((t for t, ok in self.answers if t >= end and ok), None)
        return end - start, (hit - start) if hit is not None else None, float(np.median(before)) if before else 0.0


def _fill(d: DaemonProcess, n: int, block: int) -> tuple[list[bytes], list[bytes]]:
    keys = [b"blk-%06d" % i for i in range(n)]
    rng = np.random.default_rng(0)
    values = [rng.bytes(block) for _ in range(min(n, 64))]
    with d.client() as c:
        c.register_namespace(NS)
        for i in range(0, n, 32):
            part = keys[i:i + 32]
            c.put_many(NS, part, [values[j % len(values)] for j in range(i, i + len(part))])
        wait_until(lambda: c.stats().disk.blocks >= n, 600, what="every block on disk")  # type: ignore[union-attr]
        tiers = [t for i in range(0, n, 1024) for t in c.probe_tiers_many([NS], keys[i:i + 1024])[0]]
        if tiers.count(int(Tier.RAM)) != n:
            raise SystemExit(f"only {tiers.count(int(Tier.RAM))} of {n} blocks stayed in RAM: lower the fill")
    return keys, [values[j % len(values)] for j in range(n)]


def _kept(address: str, keys: list[bytes]) -> tuple[float, float]:
    with Client(address, timeout_s=30) as c:
        c.register_namespace(NS)
        tiers: list[int] = []
        for i in range(0, len(keys), 1024):
            tiers += c.probe_tiers_many([NS], keys[i:i + 1024])[0]
    n = len(keys)
    return tiers.count(int(Tier.RAM)) / n, sum(1 for t in tiers if t != int(Tier.NONE)) / n


def run_mode(mode: str, work: str, arena: int, block: int) -> Outcome:
    os.makedirs(work, exist_ok=True)
    d = DaemonProcess(workdir=work, arena_bytes=str(arena), max_block_bytes=str(max(block, 1 << 20)),
                      disk_bytes=str(4 * arena), disk_segment_bytes="64MiB", arena_lock="off", disk_wipe=True,
                      disk_write="commit")  # write-behind: every block is on disk before the restart
    d.start(timeout_s=120)
    d.args = [a for a in d.args if a != "--disk-wipe"]  # later starts keep the disk tier (but cold)
    succ: DaemonProcess | None = None
    try:
        n = int(arena * FILL) // block
        keys, values = _fill(d, n, block)
        with Prober(d.address, keys[0], values[0]) as p:
            wait_until(lambda: len(p.answers) >= 20, 60, what="the prober's first answers")
            t0 = time.monotonic()
            if mode == "hand-over":
                succ = d.successor(timeout_s=300)
            else:
                d.stop(signal.SIGTERM)
                if mode == "cold":
                    d.args.append("--disk-wipe")
                d.start(timeout_s=300)
            restart_s = time.monotonic() - t0
            t1 = time.monotonic()
            wait_until(lambda: sum(1 for t, _ in p.answers if t >= t1) >= 20, 60, what="answers after the restart")
            wait_until(lambda: any(t >= t1 and ok for t, ok in p.answers) or mode == "cold", 120,
                       what="the first hit after the restart")
        unavailable, first_hit, interval = p.result(t0)
        ram_kept, hits_kept = _kept(d.address, keys)
        return Outcome(mode, unavailable, first_hit, ram_kept, hits_kept, len(p.answers), interval, restart_s,
                       {"blocks": n, "bytes": n * block})
    finally:
        if succ is not None:
            succ.close()
        d.close()


# -- the limits ---------------------------------------------------------------------------------------------
def limits(work: str, nbytes: int) -> dict[str, float]:
    """memcpy, O_DIRECT read and memfd pass + map + xxh3 of `nbytes`, each the best of 3."""
    src = np.frombuffer(np.random.default_rng(1).bytes(nbytes), dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = 0
    memcpy = min(_timed(lambda: np.copyto(dst, src)) for _ in range(3))
    path = os.path.join(work, "limit.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, src.tobytes())
    os.fsync(fd)
    os.close(fd)
    buf = mmap.mmap(-1, nbytes)

    def direct_read() -> None:
        f = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            at = 0
            view = memoryview(buf)
            while at < nbytes:
                at += os.preadv(f, [view[at: at + (8 << 20)]], at)
        finally:
            os.close(f)
    read = min(_timed(direct_read) for _ in range(3))
    os.unlink(path)
    handover = min(_fd_pass(src.tobytes(), nbytes) for _ in range(3))
    return {"memcpy_s": memcpy, "odirect_read_s": read, "fd_pass_map_hash_s": handover,
            "memcpy_gbs": gbs(nbytes, memcpy), "odirect_read_gbs": gbs(nbytes, read)}


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _fd_pass(data: bytes, nbytes: int) -> float:
    """A memfd sent over a unix socket pair, received, mapped and hashed whole: the hand-over's raw mechanism."""
    fd = os.memfd_create("limit")
    os.ftruncate(fd, nbytes)
    with mmap.mmap(fd, nbytes) as m:
        m[:] = data
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        t0 = time.perf_counter()
        socket.send_fds(a, [b"x"], [fd])
        _, fds, _, _ = socket.recv_fds(b, 1, 1)
        with mmap.mmap(fds[0], nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)) as m:
            xxhash.xxh3_64_intdigest(memoryview(m))
        dt = time.perf_counter() - t0
        os.close(fds[0])
        return dt
    finally:
        a.close()
        b.close()
        os.close(fd)


def report(outcomes: list[Outcome], lim: dict[str, float], nbytes: int, ttft: dict[str, Any] | None) -> dict[str, Any]:
    by = {o.mode: o for o in outcomes}
    out: dict[str, Any] = {"bench": "restart", "ram_bytes": nbytes, "limits": lim,
                           "modes": {o.mode: asdict(o) for o in outcomes}}
    for o in outcomes:
        key = o.mode.replace("-", "_").replace("hand_over", "handover")
        out[f"{key}_unavailable_s"] = round(o.unavailable_s, 4)
        out[f"{key}_first_hit_s"] = None if o.first_hit_s is None else round(o.first_hit_s, 4)
        out[f"{key}_ram_kept"] = round(o.ram_kept, 4)
        out[f"{key}_hits_kept"] = round(o.hits_kept, 4)
    if ttft is not None:
        out["ttft"] = ttft
    out["targets"] = evaluate(tuple(t for t in TARGETS if t.field in out), out)  # --modes may leave hand-over out
    rows = [[o.mode, f"{o.unavailable_s:.3f}", "-" if o.first_hit_s is None else f"{o.first_hit_s:.3f}",
             f"{o.ram_kept:.3f}", f"{o.hits_kept:.3f}", f"{o.restart_s:.2f}", f"{o.probe_interval_s * 1e3:.1f} ms"]
            for o in outcomes]
    print_table(f"restart of a daemon holding {fmt_bytes(nbytes)} in RAM (every block also on disk)",
                ["way", "unavailable s", "first hit s", "RAM kept", "hits kept", "until the new one answers s",
                 "probe interval"], rows)
    h = by.get("hand-over")
    print_table("limits on the same bytes", ["what", "seconds", "GB/s"],
                [["memcpy of the RAM (a copying hand-over)", f"{lim['memcpy_s']:.3f}", f"{lim['memcpy_gbs']:.2f}"],
                 ["O_DIRECT read of the RAM (the fastest disk refill)", f"{lim['odirect_read_s']:.3f}",
                  f"{lim['odirect_read_gbs']:.2f}"],
                 ["memfd passed, mapped and hashed (the raw mechanism)", f"{lim['fd_pass_map_hash_s']:.3f}", "-"]])
    if ttft is not None:
        trows = [[k, f"{ttft[k]['ttft_p50_s']:.3f}", f"{ttft[k]['cached_fraction']:.3f}"] for k in ("recompute", "ram")]
        for o in outcomes:
            t = ttft.get(o.mode)
            if t is not None:
                trows.append([f"{o.mode}: started with it", f"{t['ttft_p50_s']:.3f}", f"{t['cached_fraction']:.3f}"])
                if "after" in t:
                    trows.append([f"{o.mode}: after it", f"{t['after']['ttft_p50_s']:.3f}",
                                  f"{t['after']['cached_fraction']:.3f}"])
        print_table("the next turn's TTFT through vLLM", ["when", "TTFT p50 s", "cached fraction"], trows)
    if h is not None:
        print(f"hand-over: RAM kept {h.ram_kept:.4f} ({mark(TARGETS, out, 'handover_ram_kept')}), unavailable "
              f"{h.unavailable_s:.3f} s ({mark(TARGETS, out, 'handover_unavailable_s')})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 256 MiB arena, two vLLM sessions")
    ap.add_argument("--arena", default="", help="arena size (default 1GiB, 256MiB with --quick)")
    ap.add_argument("--block", default="1MiB", help="block size (default 1MiB)")
    ap.add_argument("--no-vllm", action="store_true", help="skip the TTFT through vLLM")
    ap.add_argument("--modes", default=",".join(MODES), help="which restarts, comma-separated")
    ap.add_argument("--work", default="", help="directory for the daemons' sockets and disk tiers")
    args = ap.parse_args(argv)
    arena = parse_size(args.arena or ("256MiB" if args.quick else "1GiB"), "--arena")
    block = parse_size(args.block, "--block")
    modes = [m for m in args.modes.split(",") if m]
    if any(m not in MODES for m in modes):
        raise SystemExit(f"--modes: use {', '.join(MODES)}")
    work = args.work or tempfile.mkdtemp(prefix="bench-restart-")
    outcomes = []
    for m in modes:
        print(f"restart: {m} ...", file=sys.stderr, flush=True)
        outcomes.append(run_mode(m, os.path.join(work, m), arena, block))
    nbytes = int(arena * FILL) // block * block
    lim = limits(work, nbytes)
    ttft = None
    if not args.no_vllm:
        from bench.restart_vllm import ttft_across_restarts  # imports vLLM's helpers only when asked
        ttft = ttft_across_restarts(os.path.join(work, "vllm"), modes, quick=args.quick)
    out = report(outcomes, lim, nbytes, ttft)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
