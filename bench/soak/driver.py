"""The chaos driver: real daemons on loopback, N client processes, faults on a schedule, a fuzzer alongside.

Faults, in rotation (each kind at least once in a run of a few intervals):

    kill_daemon        SIGKILL the daemon the clients use, restart it at once (same socket, ports, disk dir)
    kill_lease_holder  start a client that leases blocks and sleeps, SIGKILL it: its leases must expire by TTL
    kill_client        SIGKILL a random read/write client mid-operation (reservations die with it), respawn it
    disk_fill          a burst of distinct blocks worth 1.5x the disk tier: the log fills and reclaims
    restart_peer       SIGKILL the second daemon of the cluster and restart it (only with etcd available)
    disk_enospc        (root only; once, at the start) the disk tier lives on a tmpfs a little larger than it; a
                       filler file takes the free space for 2 s while the clients write: the log cannot grow
                       (ENOSPC), the tier degrades while RAM keeps serving, then recovers when the filler goes.
                       Only at the start because segments are preallocated: once the log has reached its
                       capacity it never asks the filesystem for space again, so a later filler changes nothing.

In a background thread the driver fuzzes every RPC (kvstore.testing.fuzz, namespaces of its own) and, with the peer
tier, the data port, all while the faults happen.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import grpc

from bench.soak.values import FILL_NS, FILL_TENANT, FUZZ_NAMESPACES, SOAK_TENANT, expected, fill_key
from kvstore import Client, KVStoreError
from kvstore._proto import kvstore_pb2 as pb
from kvstore.testing import DaemonProcess, EtcdProcess, etcd_binary, peer_options
from kvstore.testing.fuzz import METHODS, FuzzStats, Pools, RandomSource, fuzz_frame, fuzz_raw, fuzz_rpc

__all__ = ["SoakConfig", "Soak"]

MIB = 1 << 20


@dataclass(frozen=True)
class SoakConfig:
    minutes: float
    clients: int = 3
    keyspace: int = 3000
    seed: int = 1
    peer: bool = True
    workdir: str = ""
    arena_bytes: int = 32 * MIB
    disk_bytes: int = 8 * MIB
    disk_quota_bytes: int = 4 * MIB   # tenant "soak" (the clients) is guaranteed this much disk; "fill" has none
    verbose: bool = True


def daemon_options(cfg: SoakConfig) -> dict[str, Any]:
    return dict(arena_bytes=cfg.arena_bytes, max_block_bytes="1MiB", disk_bytes=cfg.disk_bytes,
                disk_segment_bytes="1MiB", lease_ttl_s=2.0, reservation_ttl_s=2.0, quarantine_s=0.5,
                sweep_interval_s=0.1, promote_timeout_s=3.0, max_subscribers=2, disk_probe_interval_s=0.5,
                tenant_disk_quota=f"{SOAK_TENANT}={cfg.disk_quota_bytes}")


@dataclass
class Proc:
    role: str
    popen: subprocess.Popen
    stats: str


@dataclass
class Tally:
    faults: Counter = field(default_factory=Counter)
    fill_blocks: int = 0
    fill_bytes: int = 0
    degraded_seen: int = 0  # disk_enospc faults during which Health said DEGRADED
    recovered: int = 0      # ... after which it said SERVING again
    stats_files: list[str] = field(default_factory=list)


class Soak:
    def __init__(self, cfg: SoakConfig, stack: ExitStack) -> None:
        self.cfg = cfg
        self.stack = stack
        self.dir = cfg.workdir
        self.stop_path = os.path.join(self.dir, "STOP")
        self.tally = Tally()
        self.fuzz = FuzzStats()
        self._fuzz_stop = threading.Event()
        self._procs: list[Proc] = []
        self._n = 0
        self.etcd = stack.enter_context(EtcdProcess()) if cfg.peer and etcd_binary() else None
        self.tmpfs = self._mount_tmpfs()  # before the daemon: unmounted after it stops (ExitStack order)
        self.a = self._daemon("a", disk_dir=os.path.join(self.tmpfs, "disk") if self.tmpfs else "")
        self.b = self._daemon("b") if self.etcd is not None else None

    # -- daemons ---------------------------------------------------------------------------------------
    def _mount_tmpfs(self) -> str:
        """A tmpfs a little larger than the disk tier, for the ENOSPC fault; '' when not root or mount fails."""
        if os.geteuid() != 0:
            return ""
        path = os.path.join(self.dir, "tmpfs")
        os.makedirs(path, mode=0o700, exist_ok=True)
        size = self.cfg.disk_bytes + 4 * MIB
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", path],
                           capture_output=True)
        if r.returncode != 0:
            return ""
        self.stack.callback(subprocess.run, ["umount", "-l", path], capture_output=True)
        return path

    def _enospc(self) -> None:
        filler = os.path.join(self.tmpfs, "filler")
        try:
            with open(filler, "wb") as fh:
                chunk = b"\0" * MIB
                while True:
                    fh.write(chunk)
                    fh.flush()
        except OSError:
            pass  # ENOSPC: the filesystem is full now
        try:
            # workers keep writing: the tier should report DEGRADED at its next disk write. Up to 15 s: under
            # disk_write = evict the disk is written only when RAM evicts, and on a loaded box (a CI run) two
            # seconds passed once without one
            deadline = time.monotonic() + 15.0
            seen = False
            while time.monotonic() < deadline and not seen:
                seen = _status(self.a) == "DEGRADED"
                time.sleep(0.1)
            self.tally.degraded_seen += seen
        finally:
            os.unlink(filler)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _status(self.a) != "SERVING":
            time.sleep(0.1)
        self.tally.recovered += _status(self.a) == "SERVING"

    def _daemon(self, name: str, disk_dir: str = "") -> DaemonProcess:
        opts = daemon_options(self.cfg)
        if disk_dir:
            opts["disk_dir"] = disk_dir
        if self.etcd is not None:
            opts.update(peer_options(self.etcd, ttl_s=2.0, timeout_s=1.0))
        work = os.path.join(self.dir, name)
        os.makedirs(work, mode=0o700, exist_ok=True)
        d = DaemonProcess(workdir=work, node_id=f"soak-{name}-{os.getpid()}", **opts)
        self.stack.callback(d.close)
        return d.start(timeout_s=60)

    def restart(self, d: DaemonProcess, sig: int = signal.SIGKILL) -> None:
        d.stop(sig)
        if d._log is not None:
            d._log.close()
        d.start(timeout_s=60)

    @property
    def daemons(self) -> list[DaemonProcess]:
        return [d for d in (self.a, self.b) if d is not None]

    # -- client processes ------------------------------------------------------------------------------
    def spawn(self, role: str) -> Proc:
        self._n += 1
        stats = os.path.join(self.dir, f"{role}-{self._n}.json")
        self.tally.stats_files.append(stats)
        args = [sys.executable, "-m", "bench.soak.worker", "--role", role, "--address", self.a.address,
                "--stats", stats, "--stop", self.stop_path, "--seed", str(self.cfg.seed * 1000 + self._n),
                "--keyspace", str(self.cfg.keyspace)]
        log = open(os.path.join(self.dir, f"{role}-{self._n}.log"), "ab")
        popen = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        p = Proc(role, popen, stats)
        self._procs.append(p)
        return p

    def writers(self) -> list[Proc]:
        return [p for p in self._procs if p.role == "rw" and p.popen.poll() is None]

    # -- faults ----------------------------------------------------------------------------------------
    def kinds(self) -> list[str]:
        kinds = ["kill_daemon", "kill_lease_holder", "disk_fill", "kill_client"]
        return kinds + (["restart_peer"] if self.b is not None else [])

    def inject(self, kind: str, rng_i: int) -> None:
        if kind == "kill_daemon":
            self.restart(self.a)
        elif kind == "restart_peer":
            assert self.b is not None
            self.restart(self.b)
        elif kind == "kill_client":
            live = self.writers()
            if not live:
                return
            victim = live[rng_i % len(live)]
            victim.popen.send_signal(signal.SIGKILL)
            victim.popen.wait()
            self.spawn("rw")
        elif kind == "kill_lease_holder":
            holder = self.spawn("holder")
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not _holding(holder.stats):
                time.sleep(0.05)
            if not _holding(holder.stats):
                kind = "kill_lease_holder_without_lease"  # the daemon was down: still a client killed
            holder.popen.send_signal(signal.SIGKILL)
            holder.popen.wait()
        elif kind == "disk_fill":
            self._fill()
        elif kind == "disk_enospc":
            self._enospc()
        self.tally.faults[kind] += 1

    def _fill(self) -> None:
        """Distinct blocks worth 1.5x the disk tier, through the driver's own client."""
        target = int(self.cfg.disk_bytes * 1.5)
        sent = 0
        try:
            with Client(self.a.address, timeout_s=5, token_file="") as c:
                c.register_namespace(FILL_NS, tenant=FILL_TENANT)
                while sent < target:
                    keys = [fill_key(self.tally.fill_blocks + i) for i in range(8)]
                    vals = [expected(k) for k in keys]
                    c.put_many(FILL_NS, keys, vals)
                    self.tally.fill_blocks += len(keys)
                    sent += sum(len(v) for v in vals)
        except KVStoreError:
            pass  # a store that is full or restarting: the burst ends early, the fault still happened
        self.tally.fill_bytes += sent

    # -- fuzzer ----------------------------------------------------------------------------------------
    def start_fuzzer(self) -> threading.Thread:
        t = threading.Thread(target=self._fuzz_loop, name="soak-fuzz", daemon=True)
        t.start()
        return t

    def _fuzz_loop(self) -> None:
        """One channel for the whole run (gRPC reconnects after a daemon restart by itself); the fuzzer's
        namespaces are registered again every 200 calls, since a restart forgets namespaces without blocks."""
        src = RandomSource(self.cfg.seed)
        pools = Pools(list(FUZZ_NAMESPACES), max_block_bytes=MIB)
        data_addr = _data_address(self.a) if self.b is not None else None
        ch = grpc.insecure_channel(self.a.address)
        i = 0
        try:
            while not self._fuzz_stop.is_set():
                if i % 200 == 0:
                    for ns in FUZZ_NAMESPACES:
                        try:
                            pb_stub_register(ch, ns)
                        except grpc.RpcError:
                            pass
                i += 1
                method = src.choice(METHODS)
                if i % 10 == 0:
                    fuzz_raw(ch, method, src, self.fuzz)
                else:
                    fuzz_rpc(ch, method, src, pools, self.fuzz, timeout_s=3)
                if data_addr is not None and i % 15 == 0:
                    fuzz_frame(data_addr, src, pools, self.fuzz, timeout_s=1)
                time.sleep(0.01)
        finally:
            ch.close()

    def stop_fuzzer(self, t: threading.Thread) -> None:
        self._fuzz_stop.set()
        t.join(30)

    # -- the run ---------------------------------------------------------------------------------------
    def run(self) -> None:
        cfg = self.cfg
        for _ in range(cfg.clients):
            self.spawn("rw")
        fuzzer = self.start_fuzzer()
        if self.tmpfs:
            time.sleep(0.5)
            self.inject("disk_enospc", 0)
        kinds = self.kinds()
        duration = cfg.minutes * 60
        interval = max(1.5, min(8.0, duration / (2 * len(kinds) + 1)))
        start = time.monotonic()
        n = 0
        while time.monotonic() - start + interval <= duration:
            time.sleep(interval)
            kind = kinds[n % len(kinds)]
            self.inject(kind, n)
            n += 1
            if cfg.verbose:
                print(f"[{time.monotonic() - start:6.1f}s] fault {kind}; so far {dict(self.tally.faults)}",
                      flush=True)
        time.sleep(max(0.0, duration - (time.monotonic() - start)))
        open(self.stop_path, "w").close()
        for p in self._procs:
            try:
                p.popen.wait(20)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
        self.stop_fuzzer(fuzzer)


def pb_stub_register(ch: grpc.Channel, ns: str) -> None:
    call = ch.unary_unary("/kvstore.v1.KVStore/RegisterNamespace",
                          request_serializer=pb.RegisterNamespaceRequest.SerializeToString,
                          response_deserializer=pb.RegisterNamespaceResponse.FromString)
    call(pb.RegisterNamespaceRequest(name=ns), timeout=3)


def _data_address(d: DaemonProcess) -> tuple[str, int] | None:
    try:
        with Client(d.address, timeout_s=2, token_file="") as c:
            peers = c.health().peers
            addr = peers.data_address if peers is not None else ""
    except KVStoreError:
        return None
    host, _, port = addr.rpartition(":")
    return (host, int(port)) if port.isdigit() else None


def _status(d: DaemonProcess) -> str:
    try:
        with Client(d.address, timeout_s=2, token_file="") as c:
            return c.health().status
    except KVStoreError:
        return "UNAVAILABLE"


def _holding(path: str) -> bool:
    import json
    try:
        with open(path) as fh:
            return json.load(fh).get("holding", 0) > 0
    except (OSError, ValueError):
        return False
