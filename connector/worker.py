"""Worker side of the connector: moves bytes between vLLM's paged KV cache and the daemon's arena.

Save (in wait_for_save, after the step's forward wrote the KV): one Reserve for the step's new stored blocks
(keys the store already has come back ALREADY_PRESENT and are skipped), one batched gather of every reserved
block's pieces across all layers into its arena slot, then Commit on a background thread. A request with more
keys than the daemon's max_batch_keys (a 64K-token prompt at one 16-token block per key) is split into parts
of that many keys, each its own Reserve / gather / Commit (and, for a load, its own Lookup lease). The gather itself
is done before wait_for_save returns (CPU) or ordered before every later kernel on the compute stream (CUDA:
cuda_copy.fence right after the launch), so a block vLLM frees and reuses later can never leak into the store.

Load (start_load_kv, for requests waiting in WAITING_FOR_REMOTE_KVS, or scheduled in this step for a
synchronous load, which start_load_kv waits for): on a background thread, Lookup with a lease, one batched
scatter from the leased slots into the request's blocks, check the slots' generations (a lease that expired
mid-copy means those bytes may be stale), Release. Anything that goes wrong — store
down, a key evicted since the scheduler's lookup, a lease lost, a wrong block size — marks that job's
vLLM blocks as failed: vLLM (kv_load_failure_policy="recompute") recomputes them instead of failing.

get_finished reports loads as received (failed ones too, as vLLM requires). It never reports sends: a save
reads vLLM's blocks only during its gather, which is complete when wait_for_save returns (CPU) or ordered
before any later kernel (CUDA), so vLLM may free a finished request's blocks at once; the Commit that follows
touches only the arena. (Holding blocks until commits finish would also block reset_prefix_cache.)

KV cache groups (hybrid models, connector/groups.py): each group has its own layers, namespace and block table;
every job carries one block list per group, and each group is loaded and saved on its own (its own Lookup lease
or Reserve, gather and Commit). A load copies the keys of a group that have a block to fill; a save stores the
keys whose blocks are all given (the scheduler marks what a group does not keep or store with -1).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np

from connector.config import ConnectorConfig
from connector.copier import Copier, make_copier
from connector.layout import KVLayout, LayoutError
from connector.link import StoreLink
from connector.namespace import KVLayoutSpec, namespace_for
from connector.plan import LoadJob, SaveJob
from connector.stats import ConnectorCounters
from kvstore.client import Client, arena_path
from kvstore.client.arena_map import ArenaMap
from kvstore.client.types import Reservation
from kvstore.errors import KVStoreError, UnknownNamespaceError
from kvstore.vocab import ReserveOutcome

__all__ = ["WorkerSide"]

_RESERVED = int(ReserveOutcome.RESERVED)  # a plain int: compared once per saved block

log = logging.getLogger(__name__)


class WorkerSide:
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
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="kvstore-commit")
        self._lock = threading.Lock()
        self._recv_done: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._failed_reqs: set[str] = set()  # asynchronous loads that failed, by request (several groups)
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
            from connector.cuda_copy import compute_marker  # noqa: PLC0415 - GPU nodes only

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
        try:
            ok = self._load_inner(job, after)
        except Exception:  # noqa: BLE001 - a load must fail toward recompute, never crash the worker
            log.exception("kvstore load for request %s failed", job.req_id)
        failed = [b for blocks in job.block_ids for b in blocks if b >= 0] if not ok else []
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

    def _load_inner(self, job: LoadJob, after: Any = None) -> bool:
        """Every group's keys that have a block to fill, in parts of at most max_batch_keys (one Lookup lease
        each); any part that fails fails the whole job (vLLM recomputes from its first failed block anyway)."""
        c = self._client()
        if c is None:
            return False
        n = max(1, c.max_batch_keys)
        nbytes = nkeys = 0
        for gi, blocks in enumerate(job.block_ids):
            ns = namespace_for(self.specs[gi], job.cache_salt)
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

    # -- saves -------------------------------------------------------------------------------------------
    def save(self, jobs: list[SaveJob]) -> None:
        """Gather now (the KV of this step exists now), commit in the background.

        Each KV cache group is saved on its own: the keys whose blocks the job gives in full. A job with more
        keys than the daemon takes in one RPC (max_batch_keys, 4096 by default: a 64K-token prompt at one
        16-token block per key) is saved as consecutive parts, each its own Reserve, gather and Commit; a failed
        part costs only its own keys. A job's parts are reserved together, pipelined (Client.reserve_many: one
        round trip on vLLM's thread for every group of a hybrid model, not one per group)."""
        for job in jobs:
            parts = self._parts(job)
            t0 = time.perf_counter()
            try:
                reserved = self._reserve(parts)
            except Exception:  # noqa: BLE001 - a failed save is a future miss, never a failed request
                log.exception("kvstore save for request %s failed", job.req_id)
                self.counters.add(save_failures=len(parts))
                continue
            for (group, part), res in zip(parts, reserved):
                try:
                    self._save_one(group, part, res, t0)
                except Exception:  # noqa: BLE001 - a failed save is a future miss, never a failed request
                    log.exception("kvstore save for request %s failed", part.req_id)
                    self.counters.add(save_failures=1)

    def _reserve(self, parts: list[tuple[int, SaveJob]]) -> list[Reservation | None]:
        """One Reserve per part, pipelined; None for a part the daemon refused (or every part, store down)."""
        if not parts or self._client() is None:
            return [None] * len(parts)
        reqs = [(namespace_for(self.specs[g], p.cache_salt), p.keys, [self.group_key_bytes(g)] * len(p.keys))
                for g, p in parts]

        def reserve(cl: Client) -> list[Reservation | KVStoreError]:
            out = cl.reserve_many(reqs)
            unknown = next((r for r in out if isinstance(r, UnknownNamespaceError)), None)
            if unknown is not None:  # the daemon restarted and forgot a namespace: give back what was reserved,
                for r in out:        # and let the link register the namespaces and ask again
                    if isinstance(r, Reservation):
                        cl.abort(r)
                raise unknown
            return out
        got = self.link.call([ns for ns, _, _ in reqs], reserve)
        if got is None:
            return [None] * len(parts)
        for r in got:
            if isinstance(r, KVStoreError):
                log.warning("kvstore reserve failed: %s", r)
        return [r if isinstance(r, Reservation) else None for r in got]

    def _batch_keys(self) -> int:
        c = self.link.client
        return max(1, c.max_batch_keys) if c is not None else 1 << 62

    def _parts(self, job: SaveJob) -> list[tuple[int, SaveJob]]:
        """(group, a job of one group's complete keys, at most max_batch_keys of them) pairs."""
        n, g = self._batch_keys(), self.spec.blocks_per_key
        out = []
        for gi, blocks in enumerate(job.block_ids):
            have = self._blocks(blocks)
            idx = np.flatnonzero((have >= 0).all(axis=1))
            keys, flat = [job.keys[i] for i in idx], have[idx].reshape(-1).tolist()
            out += [(gi, replace(job, keys=keys[i:i + n], block_ids=[flat[i * g:(i + n) * g]]))
                    for i in range(0, len(keys), n)]
        return out

    def _save_one(self, group: int, job: SaveJob, res: Reservation | None, t0: float) -> None:
        """Save one group's part (``job.block_ids`` holds that group's blocks only) into its reservation."""
        c = self._client()
        if c is None or res is None:
            self.counters.add(save_failures=1)
            return
        ns = namespace_for(self.specs[group], job.cache_salt)
        idx = [i for i, o in enumerate(res.outcomes) if o == _RESERVED]
        self.counters.add(save_skipped_blocks=len(job.keys) - len(idx))
        if not idx:
            return  # nothing reserved: the daemon holds no reservation to abort
        m = c.acquire_arena(res.incarnation)  # held until the commit thread has waited for the gather
        if m is None:
            self.counters.add(save_failures=1)
            self.link.call(ns, lambda cl: cl.abort(res))  # a restarted daemon may not know it: then a no-op
            return
        try:
            copier = self._copier_for(m)
            blocks = self._blocks(job.block_ids[0])[idx]
            slots = np.uint64(m.address) + np.asarray([res.offsets[i] for i in idx], dtype=np.uint64)
            plan = self.layouts[group].plan(slots, blocks, to_store=True)
            handle = copier.copy(plan)
            fence = getattr(copier, "fence", None)  # CUDA: every later kernel on the compute stream (the next
            if fence is not None:                   # forward, block zeroing) waits for this gather, on the GPU
                fence()
            self._futures.append(self._committer.submit(self._commit, job, ns, res, m, copier, handle, len(idx),
                                                        plan.nbytes, t0))
        except BaseException:
            m.release()
            raise

    def _commit(self, job: SaveJob, ns: str, res: Any, m: ArenaMap, copier: Copier, handle: Any, n: int,
                nbytes: int, t0: float) -> None:
        try:
            copier.wait(handle)
            m.release()  # the gather is done: the mapping may go (the commit touches no arena memory)
            m = None  # type: ignore[assignment]  # released above: None tells `finally` not to release it again
            done = self.link.call(ns, lambda cl: cl.commit(res))
            if done is None:
                self.counters.add(save_failures=1)
            else:
                self.counters.add(saved_blocks=n, saved_bytes=nbytes, save_seconds=time.perf_counter() - t0)
        except Exception:  # noqa: BLE001
            log.exception("kvstore commit for request %s failed", job.req_id)
            self.counters.add(save_failures=1)
        finally:
            if m is not None:
                m.release()

    # -- completion --------------------------------------------------------------------------------------
    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests whose sends finished: always empty, see the module docstring; requests whose loads are
        done, failed or not)."""
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
        self._futures = [f for f in self._futures if not f.done()]
        return set(), recv, failed

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
