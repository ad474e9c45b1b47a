"""The worker side's saves (a mixin of WorkerSide): a step's new blocks gathered into arena slots, then stored.

Two ways, chosen per part (one KV cache group's keys of one request, at most max_batch_keys of them):
- through spare slots (kvstore/client/slot_bank.py): vLLM's thread takes slots the daemon granted ahead, with
  no request, and gathers into them; the commit thread stores them with one Store, which also brings the
  slots that replace them. A key the store already has is gathered for nothing and its slot kept (the Store
  says it was present: counted as skipped). Parts of at most BANKED_KEYS keys, while the bank has slots. The
  Store then runs in the daemon during the next step's gather; measured on 2 cores, 512-token steps of 64 MiB
  (wait_for_save p50, spare slots vs Reserve, alternating in one process): 3.66 vs 4.04 and 4.31 vs 4.77 ms at
  copy_threads=2 (the copy's threads share its chunks, so the Store's core is taken over, not waited for),
  5.69 vs 6.67 ms at copy_threads=1;
- else Reserve (one round trip on vLLM's thread for every part of a step, pipelined), a gather of the keys
  reserved (present ones are skipped), and Commit on the commit thread.
Either way the gather is complete when save returns (CPU), or ordered before every later kernel on vLLM's
compute stream (CUDA: the copier's fence), so vLLM may reuse the blocks at once; what follows touches only
the arena. A failed save is a future miss, never a failed request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore_connector.copier import Copier
from kvstore_connector.layout import KVLayout
from kvstore_connector.link import StoreLink
from kvstore_connector.namespace import KVLayoutSpec, namespace_for
from kvstore_connector.plan import SaveJob
from kvstore_connector.stats import ConnectorCounters
from kvstore.client import Client
from kvstore.client.arena_map import ArenaMap
from kvstore.client.slot_bank import SlotBank, Taken
from kvstore.client.types import Reservation
from kvstore.errors import KVStoreError, UnknownNamespaceError
from kvstore.vocab import ReserveOutcome

__all__ = ["Saves", "BANKED_KEYS"]

_RESERVED = int(ReserveOutcome.RESERVED)  # a plain int: compared once per saved block
# A bank's grant is 64 slots (the daemon's limit per connection): parts of up to half of that can be taken
# while the previous step's part is still being stored. A larger part reserves (its round trip is small
# against its gather).
BANKED_KEYS = 32

log = logging.getLogger(__name__)

# finish(client, namespace) -> (outcome per key, how many stored): a Store of banked slots, or a Commit
Finish = Callable[[Client, str], tuple[list[int], int]]


class Saves:
    config: Any
    spec: KVLayoutSpec
    specs: list[KVLayoutSpec]
    link: StoreLink
    counters: ConnectorCounters
    layouts: list[KVLayout]
    _committer: ThreadPoolExecutor
    _futures: list[Future[Any]]

    if TYPE_CHECKING:  # WorkerSide's own methods this mixin calls: declared for the type checker only
        def _client(self) -> Client | None: ...
        def _copier_for(self, m: ArenaMap) -> Copier: ...
        def _blocks(self, block_ids: list[int]) -> np.ndarray: ...
        def group_key_bytes(self, group: int) -> int: ...
        def _released(self, req_id: str) -> None: ...

    def save(self, jobs: list[SaveJob]) -> None:
        """Gather now (the KV of this step exists now), store in the background (module docstring). A job with
        more keys than the daemon takes in one request (max_batch_keys, 4096 by default: a 64K-token prompt at
        one 16-token block per key) is saved as consecutive parts; a failed part costs only its own keys. The
        parts that reserve are reserved together, pipelined (Client.reserve_many: one round trip on vLLM's
        thread for every group of a hybrid model, not one per group)."""
        for job in jobs:
            try:
                self._save_job(job)
            finally:
                if job.release:  # a finished request's tail (kvstore_connector/tails.py): gathered or failed, vLLM may
                    self._released(job.req_id)  # free its blocks now

    def _save_job(self, job: SaveJob) -> None:
        """One job's parts: spare slots where the bank has them, else one pipelined Reserve for the rest."""
        parts = self._parts(job)
        t0 = time.perf_counter()
        banked = [self._take(group, part) for group, part in parts]
        try:
            reserved = iter(self._reserve([p for p, b in zip(parts, banked) if b is None]))
        except Exception:  # noqa: BLE001 - a failed save is a future miss, never a failed request
            log.exception("kvstore save for request %s failed", job.req_id)
            reserved = iter([None] * len(parts))  # each such part counts its failure (_save_one)
        for (group, part), bank in zip(parts, banked):
            try:
                if bank is None:
                    self._save_one(group, part, next(reserved), t0)
                else:
                    self._save_banked(group, part, *bank, t0)
            except Exception:  # noqa: BLE001 - a failed save is a future miss, never a failed request
                log.exception("kvstore save for request %s failed", part.req_id)
                self.counters.add(save_failures=1)

    # -- through spare slots -----------------------------------------------------------------------------
    def _take(self, group: int, part: SaveJob) -> tuple[SlotBank, Taken] | None:
        """Spare slots for every key of the part, or None (then it reserves)."""
        c = self._client()
        if c is None or not 0 < len(part.keys) <= BANKED_KEYS:
            return None
        bank = c.slot_bank(self.group_key_bytes(group))
        taken = bank.take(len(part.keys)) if bank is not None else None
        return (bank, taken) if bank is not None and taken is not None else None

    def _save_banked(self, group: int, job: SaveJob, bank: SlotBank, taken: Taken, t0: float) -> None:
        c = self._client()
        m = c.acquire_arena(taken.incarnation) if c is not None else None
        if m is None:  # the daemon restarted since the slots were granted: they are gone with its arena
            bank.give_back(taken)
            self.counters.add(save_failures=1)
            return
        try:
            slots = np.uint64(m.address) + np.asarray(taken.offsets, dtype=np.uint64)
            self._gather(group, job, m, slots, self._blocks(job.block_ids[0]), t0,
                         lambda _cl, ns: bank.store(ns, job.keys, taken), lambda: bank.give_back(taken))
        except BaseException:
            bank.give_back(taken)
            raise

    # -- through Reserve and Commit ----------------------------------------------------------------------
    def _reserve(self, parts: list[tuple[int, SaveJob]]) -> list[Reservation | None]:
        """One Reserve per part, pipelined; None for a part the daemon refused (or every part, store down)."""
        if not parts or self._client() is None:
            return [None] * len(parts)
        reqs = [(self._ns(g, p.cache_salt), p.keys, [self.group_key_bytes(g)] * len(p.keys)) for g, p in parts]

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

    def _ns(self, group: int, cache_salt: str | None) -> str:
        """The namespace of `group`'s blocks for this salt and this process's tenant (known: the callers hold a
        connected client)."""
        return namespace_for(self.specs[group], cache_salt, self.link.tenant or "")

    def _batch_keys(self) -> int:
        c = self.link.client
        return max(1, c.max_batch_keys) if c is not None else 1 << 62

    def _parts(self, job: SaveJob) -> list[tuple[int, SaveJob]]:
        """(group, a job of one group's complete keys, at most max_batch_keys of them) pairs."""
        n, g = self._batch_keys(), self.spec.blocks_per_key
        # the usual step, one group with every block there, is the job itself (58 -> 6 us on vLLM's thread)
        if len(job.block_ids) == 1 and 0 < len(job.keys) <= n:
            ids = job.block_ids[0]
            if len(ids) == len(job.keys) * g and min(ids) >= 0:
                return [(0, job)]
        out = []
        for gi, blocks in enumerate(job.block_ids):
            have = self._blocks(blocks)
            idx = np.flatnonzero((have >= 0).all(axis=1))
            keys, flat = [job.keys[i] for i in idx], have[idx].reshape(-1).tolist()
            origins = [job.origins[i] for i in idx if i < len(job.origins)]
            out += [(gi, replace(job, keys=keys[i:i + n], block_ids=[flat[i * g:(i + n) * g]],
                                 origins=tuple(origins[i:i + n]))) for i in range(0, len(keys), n)]
        return out

    def _save_one(self, group: int, job: SaveJob, res: Reservation | None, t0: float) -> None:
        """Save one group's part (``job.block_ids`` holds that group's blocks only) into its reservation."""
        c = self._client()
        if c is None or res is None:
            self.counters.add(save_failures=1)
            return
        idx = [i for i, o in enumerate(res.outcomes) if o == _RESERVED]
        self.counters.add(save_skipped_blocks=len(job.keys) - len(idx))
        if not idx:
            return  # nothing reserved: the daemon holds no reservation to abort
        m = c.acquire_arena(res.incarnation)  # held until the commit thread has waited for the gather
        ns = self._ns(group, job.cache_salt)
        if m is None:
            self.counters.add(save_failures=1)
            self.link.call(ns, lambda cl: cl.abort(res))  # a restarted daemon may not know it: then a no-op
            return
        slots = np.uint64(m.address) + np.asarray([res.offsets[i] for i in idx], dtype=np.uint64)
        n = len(idx)

        def commit(cl: Client, _ns: str) -> tuple[list[int], int]:
            return [_RESERVED] * n, cl.commit(res)
        self._gather(group, job, m, slots, self._blocks(job.block_ids[0])[idx], t0, commit, lambda: None)

    # -- both ways ---------------------------------------------------------------------------------------
    def _gather(self, group: int, job: SaveJob, m: ArenaMap, slots: np.ndarray, blocks: np.ndarray, t0: float,
                finish: Finish, undo: Callable[[], None]) -> None:
        """Gather `blocks` into `slots` now, then on the commit thread `finish(client, namespace)` -> (outcome per key,
        stored). `m` is held until the gather is done (released here on failure); `undo` runs when `finish`
        fails for good."""
        try:
            copier = self._copier_for(m)
            plan = self.layouts[group].plan(slots, blocks, to_store=True)
            handle = copier.copy(plan)
            fence = getattr(copier, "fence", None)  # CUDA: every later kernel on the compute stream (the next
            if fence is not None:                   # forward, block zeroing) waits for this gather, on the GPU
                fence()
        except BaseException:
            m.release()
            raise
        ns = self._ns(group, job.cache_salt)
        per_key = plan.nbytes // max(1, len(slots))
        self._futures.append(self._committer.submit(self._finish, job, ns, m, copier, handle, finish, undo, per_key,
                                                    t0))

    def _annotated(self, cl: Client, ns: str, job: SaveJob, finish: Finish) -> tuple[list[int], int]:
        """finish(cl, ns), after vLLM's identity of the part's keys went to the daemon on this same client
        (kvstore_connector/origins.py), so its vLLM-format events name them by vLLM's hashes. A failed annotate
        costs only the names (the blocks are published under our keys, flagged), never the save."""
        if job.origins:
            n = len(job.origins)
            try:
                self.counters.add(annotated_keys=cl.annotate(ns, job.keys[:n], job.origins))
            except KVStoreError as exc:
                log.warning("kvstore annotate of %d keys failed (saved all the same): %s", n, exc)
                self.counters.add(annotate_failures=1)
        return finish(cl, ns)

    def _finish(self, job: SaveJob, ns: str, m: ArenaMap, copier: Copier, handle: Any,
                finish: Finish, undo: Callable[[], None], per_key: int,
                t0: float) -> None:
        """On the commit thread: wait for the gather, let the mapping go, store (Store or Commit)."""
        try:
            copier.wait(handle)
            m.release()
            m = None  # type: ignore[assignment]  # released above: None tells `finally` not to release it again
            done = self.link.call(ns, lambda cl: self._annotated(cl, ns, job, finish))
            if done is None:
                undo()
                self.counters.add(save_failures=1)
            else:
                outcomes, stored = done
                self.counters.add(saved_blocks=stored, saved_bytes=stored * per_key,
                                  save_skipped_blocks=len(outcomes) - stored,
                                  save_seconds=time.perf_counter() - t0)
        except Exception:  # noqa: BLE001
            log.exception("kvstore store for request %s failed", job.req_id)
            self.counters.add(save_failures=1)
        finally:
            if m is not None:
                m.release()
