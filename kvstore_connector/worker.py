"""Worker side of the connector: moves bytes between vLLM's paged KV cache and the daemon's arena.

Save (in wait_for_save, after the step's forward wrote the KV; saves.py): one batched gather of the step's new
blocks' pieces across all layers into arena slots, either spare slots the daemon granted ahead (no request on
vLLM's thread; one Store on a background thread) or slots reserved for them (one Reserve; Commit on that
thread). A request with more keys than the daemon's max_batch_keys (a 64K-token prompt at one 16-token block
per key) is split into parts of that many keys (and, for a load, its own Lookup lease each). The gather itself
is done before wait_for_save returns (CPU) or ordered before every later kernel on the compute stream (CUDA:
cuda_copy.fence right after the launch), so a block vLLM frees and reuses later can never leak into the store.

Load (start_load_kv, for requests waiting in WAITING_FOR_REMOTE_KVS, or scheduled in this step for a
synchronous load, which start_load_kv waits for): on a background thread, Lookup with a lease, one batched
scatter from the leased slots into the request's blocks, check the slots' generations (a lease that expired
mid-copy means those bytes may be stale), Release. Anything that goes wrong — store
down, a key evicted since the scheduler's lookup, a lease lost, a wrong block size — marks that job's
vLLM blocks as failed: vLLM (kv_load_failure_policy="recompute") recomputes them instead of failing.

get_finished reports loads as received (failed ones too, as vLLM requires). A save reads vLLM's blocks only
during its gather, which is complete when wait_for_save returns (CPU) or ordered before any later kernel
(CUDA), so vLLM may free a finished request's blocks at once; the Commit that follows touches only the arena.
(Holding blocks until commits finish would also block reset_prefix_cache.) The one send reported is a finished
request's partial last block (kvstore_connector/tails.py): vLLM held its blocks for that gather, and the request is
reported sent in the step that gathered it (or failed to).

KV cache groups (hybrid models, kvstore_connector/groups.py): each group has its own layers, namespace and block table;
every job carries one block list per group, and each group is loaded and saved on its own (its own Lookup lease,
or slots, gather and Store or Commit). A load copies the keys of a group that have a block to fill; a save stores the
keys whose blocks are all given (the scheduler marks what a group does not keep or store with -1).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from kvstore_connector.claims import await_claimed
from kvstore_connector.config import ConnectorConfig
from kvstore_connector.copier import Copier, make_copier
from kvstore_connector.layout import KVLayout, LayoutError
from kvstore_connector.link import StoreLink
from kvstore_connector.namespace import KVLayoutSpec, namespace_for
from kvstore_connector.plan import LoadJob
from kvstore_connector.saves import Saves
from kvstore_connector.stats import ConnectorCounters
from kvstore.client import Client, arena_path
from kvstore.client.arena_map import ArenaMap
from kvstore.client.fast_channel import quiet_thread

__all__ = ["WorkerSide"]

log = logging.getLogger(__name__)


class WorkerSide(Saves):
    def __init__(self, config: ConnectorConfig, spec: KVLayoutSpec, link: StoreLink,
                 counters: ConnectorCounters | None = None, *, group_specs: Sequence[KVLayoutSpec] = (),
                 group_layers: Sequence[Sequence[str]] = ()) -> None:
        """``group_specs``: this worker's spec of every KV cache group, in group order (default: ``spec`` alone);
        ``group_layers``: each group's layer names (default: every registered layer)."""
        self.config = config
        self.spec = spec
        self.specs = list(group_specs) or [spec]
        self._group_layers = [list(names) for names in group_layers]
        self.link = link
        self.counters = counters or ConnectorCounters()
        self.layout: KVLayout | None = None  # group 0's (the only one without hybrid groups)
        self.layouts: list[KVLayout] = []
        self._copier: Copier | None = None
        self._copier_map: ArenaMap | None = None  # the mapping _copier is bound to
        self._copier_lock = threading.Lock()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvstore-load")
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="kvstore-commit", initializer=quiet_thread)
        self._lock = threading.Lock()
        self._recv_done: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._failed_reqs: set[str] = set()  # asynchronous loads that failed, by request (several groups)
        self._sent: set[str] = set()  # finished requests whose tail was gathered: vLLM may free their blocks
        self._futures: list[Future[Any]] = []
        self._disabled_reason = ""

    # -- setup -------------------------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, Any], num_blocks: int) -> None:
        """One layout per KV cache group, over that group's layers (several groups' layers may share one tensor:
        the groups' block tables then index disjoint blocks of it)."""
        layouts = []
        for gi, spec in enumerate(self.specs):
            names = self._group_layers[gi] if gi < len(self._group_layers) and len(self.specs) > 1 else list(kv_caches)
            mine = {n: kv_caches[n] for n in names if n in kv_caches}
            if not mine:
                raise LayoutError(f"KV cache group {gi} names layers {names[:4]}... none of which were registered "
                                  f"(registered: {list(kv_caches)[:4]}...)")
            lay = KVLayout(mine, num_blocks)
            if lay.block_bytes != spec.block_bytes:
                log.warning("KV cache group %d: %d bytes per vLLM block, the config predicts %d: stored blocks use "
                            "the real size", gi, lay.block_bytes, spec.block_bytes)
            layouts.append(lay)
        self.layouts, self.layout = layouts, layouts[0]
        log.info("kvstore connector: %d KV cache group(s), %d layers, %s B per vLLM block, %d per stored block, "
                 "device %s", len(layouts), sum(len(x.layer_names) for x in layouts),
                 "+".join(str(x.block_bytes) for x in layouts), self.spec.blocks_per_key, self.layout.device)

    @property
    def key_bytes(self) -> int:
        """Bytes of one stored block of group 0 (the only group without hybrid groups)."""
        return self.group_key_bytes(0)

    def group_key_bytes(self, group: int) -> int:
        assert self.layouts
        return self.layouts[group].block_bytes * self.spec.blocks_per_key

    def _client(self) -> Client | None:
        """The connected client when it can move bytes through the arena; None otherwise (store down, or the
        daemon's arena cannot be mapped from here)."""
        c = self.link.client
        if c is None or self.layout is None:
            return None
        if c.mode != "arena":
            if not self._disabled_reason:
                self._disabled_reason = "the daemon's arena cannot be mapped (daemon on another host?)"
                log.error("kvstore connector: %s; it needs kvstore-server on the same node", self._disabled_reason)
            return None
        return c

    def _copier_for(self, m: ArenaMap) -> Copier:
        """The copier bound to mapping `m` (made on first use; the mapping's close hook closes it)."""
        assert self.layout is not None
        with self._copier_lock:
            if self._copier is None or self._copier_map is not m:
                self._copier = make_copier(self.layout.device, m, self.config.copy_threads)
                self._copier_map = m
            return self._copier

    def _blocks(self, block_ids: list[int]) -> np.ndarray:
        return np.asarray(block_ids, dtype=np.int64).reshape(-1, self.spec.blocks_per_key)

    # -- loads -------------------------------------------------------------------------------------------
    def start_loads(self, jobs: list[LoadJob]) -> None:
        """Called on vLLM's thread: on CUDA, mark its compute stream now so the loads (launched later from
        the loader thread, whose current stream is another one) run after everything vLLM queued so far.
        Synchronous jobs are waited for here: their requests run in this step's forward. The loader thread
        did the copy and synchronized its stream, so on CUDA too the blocks hold their bytes before any
        kernel vLLM queues after this returns. A failed one fails toward recompute like any load."""
        if not jobs:
            return
        after = None
        if self.layout is not None and self.layout.is_cuda:
            from kvstore_connector.cuda_copy import compute_marker  # noqa: PLC0415 - GPU nodes only

            after = compute_marker(self.layout.device)
        waits: list[Future[Any]] = []
        for job in jobs:
            f = self._loader.submit(self._load, job, after)
            (waits if job.sync else self._futures).append(f)
        for f in waits:
            f.result()  # _load never raises: its failures are recorded as failed blocks

    def _load(self, job: LoadJob, after: Any = None) -> None:
        t0 = time.perf_counter()
        ok = False
        late: list[int] = []  # blocks of keys another scheduler did not save in time (claims.py): computed
        try:
            if job.wait_s > 0:
                job, late = await_claimed(job, lambda: self._held(job), self.counters)
            ok = self._load_inner(job, after)
        except Exception:  # noqa: BLE001 - a load must fail toward recompute, never crash the worker
            log.exception("kvstore load for request %s failed", job.req_id)
        failed = ([b for blocks in job.block_ids for b in blocks if b >= 0] if not ok else []) + late
        with self._lock:
            if len(self.specs) > 1 and not job.sync:
                if failed:  # block ids repeat across KV cache groups: vLLM takes the failure by request
                    self._failed_reqs.add(job.req_id)
            else:
                self._failed_blocks.update(failed)
            if not job.sync:  # vLLM waits for the report of an asynchronous load only
                self._recv_done.add(job.req_id)
        self.counters.add(load_seconds=time.perf_counter() - t0)
        if not ok:
            self.counters.add(load_failed_blocks=len(failed))

    def _held(self, job: LoadJob) -> list[bool]:
        """Per key of the job: held in every group's namespace, on this node or at its owner (metadata only). A
        store that cannot be asked answers "all held": the load that follows then fails or succeeds by itself,
        rather than waiting out the claim for nothing."""
        c = self._client()
        out = [True] * len(job.keys)
        if c is None:
            return out
        for gi in range(len(job.block_ids)):
            got = self._exists(namespace_for(self.specs[gi], job.cache_salt, c.tenant), job.keys)
            if got is None:
                return [True] * len(job.keys)
            out = [a and b for a, b in zip(out, got)]
        return out

    def _exists(self, ns: str, keys: list[bytes]) -> list[bool] | None:
        return self.link.call(ns, lambda cl: cl.exists(ns, keys, cluster=True))

    def _load_inner(self, job: LoadJob, after: Any = None) -> bool:
        """Every group's keys that have a block to fill, in parts of at most max_batch_keys (one Lookup lease
        each); any part that fails fails the whole job (vLLM recomputes from its first failed block anyway)."""
        c = self._client()
        if c is None:
            return False
        n = max(1, c.max_batch_keys)
        nbytes = nkeys = 0
        for gi, blocks in enumerate(job.block_ids):
            ns = namespace_for(self.specs[gi], job.cache_salt, c.tenant)
            want = self._blocks(blocks)
            idx = np.flatnonzero((want >= 0).any(axis=1))
            keys = [job.keys[i] for i in idx]
            for i in range(0, len(keys), n):
                got_bytes = self._load_part(c, ns, gi, job.req_id, keys[i:i + n], want[idx[i:i + n]], after)
                if got_bytes is None:
                    return False
                nbytes += got_bytes
            nkeys += len(keys)
        self.counters.add(loaded_blocks=nkeys, loaded_bytes=nbytes)
        return True

    def _load_part(self, c: Client, ns: str, group: int, req_id: str, keys: list[bytes], block_ids: np.ndarray,
                   after: Any = None) -> int | None:
        """Bytes copied into ``block_ids``, or None when this part cannot be loaded.

        The copy, the wait for it and the generation check all run under one reference to the mapping the
        lease belongs to (kvstore/client/arena_map.py): a reconnect or close() in another thread can replace
        the mapping but never unmap it under this copy."""
        lease = self.link.call(ns, lambda cl: cl.lookup(ns, keys, lease=True))
        if lease is None:
            return None
        try:
            key_bytes = self.group_key_bytes(group)
            if lease.hits != len(keys) or any(s != key_bytes for s in lease.sizes):
                log.warning("kvstore load for %s: %d of %d blocks present in group %d (sizes %s, expected %d)",
                            req_id, lease.hits, len(keys), group, sorted(set(lease.sizes)), key_bytes)
                return None
            m = c.acquire_arena(lease.incarnation)
            if m is None:
                log.warning("kvstore load for %s: the daemon restarted during the lookup", req_id)
                return None
            with m:
                copier = self._copier_for(m)
                slots = np.uint64(m.address) + np.asarray(lease.offsets, dtype=np.uint64)
                plan = self.layouts[group].plan(slots, block_ids, to_store=False)
                copier.wait(copier.copy(plan, after))
                if any(v is None for v in arena_path.validated(m, lease, [1] * lease.hits)):
                    log.warning("kvstore load for %s: a lease expired during the copy", req_id)
                    return None
                return plan.nbytes
        finally:
            c.release([lease])

    # -- completion --------------------------------------------------------------------------------------
    def _released(self, req_id: str) -> None:
        with self._lock:
            self._sent.add(req_id)

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished requests whose partial last block is gathered, see the module docstring; requests whose
        loads are done, failed or not)."""
        sent, recv, _ = self.transfer_results(finished_req_ids)
        return sent, recv

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """`finished`, plus the requests among the received ones whose load failed as a whole: with several KV
        cache groups a failure is reported this way (vLLM recomputes the request), since block ids repeat
        across groups; with one group it is reported block by block (`load_errors`), so vLLM keeps the blocks
        before the first failed one."""
        with self._lock:
            recv, self._recv_done = self._recv_done, set()
            failed, self._failed_reqs = self._failed_reqs & recv, self._failed_reqs - recv
            sent, self._sent = self._sent, set()
        self._futures = [f for f in self._futures if not f.done()]
        return sent, recv, failed

    def load_errors(self) -> set[int]:
        with self._lock:
            out, self._failed_blocks = self._failed_blocks, set()
        return out

    def drain(self, timeout_s: float = 30.0) -> None:
        """Wait for every started load and commit (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        for f in list(self._futures):
            f.result(timeout=max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._loader.shutdown(wait=True)
            self._committer.shutdown(wait=True)
            # the copier closes with its mapping (when the link's client is closed and the last copy is done)
