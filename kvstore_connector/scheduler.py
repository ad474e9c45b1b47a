"""Scheduler side of the connector: metadata only, no bytes.

Per request it keeps the chained keys of its full stored blocks (`KeyChain`; a new request's keys of a prefix
vLLM has hashed already come from the key memo, kvstore_connector/key_memo.py), its vLLM block table, how many
stored blocks the store already has (from the lookup) and how many it has asked the worker to save. Each
step it turns that into a `StepPlan`:

- get_num_new_matched_tokens: one batched prefix Lookup per shard (pipeline stage x TP rank; lease=False:
  it only counts, and starts promoting disk-resident blocks into RAM) for the request's full stored blocks,
  pipelined into one round trip; the hit is the shortest shard's answer, since every shard must load its
  own layers and heads of each block. The answer is remembered until the request is
  scheduled, so a request waiting for GPU blocks does not cost RPCs per scheduler step. A hit all in RAM
  loads synchronously by default (load_mode "auto"): the request is scheduled in the same step and the
  worker copies its blocks before the forward; so does one whose blocks on disk or at peers (beyond vLLM's own
  cache) total at most sync_fetch_bytes, read or fetched while the step waits (the lookup started that read;
  kvstore_connector/load_policy.py).
  Other hits load asynchronously (load_kv_async=True): the request waits in WAITING_FOR_REMOTE_KVS while the
  daemon promotes or fetches and the worker copies.
  No hit is offered when this process's client is in stream mode (the daemon's arena cannot be mapped):
  the workers could not load it, and each offered hit would cost a failed load and a recompute.
- update_state_after_alloc: the blocks to load into are known; queue a `LoadJob`. Every request vLLM puts
  in WAITING_FOR_REMOTE_KVS gets exactly one job, so the worker reports it received (loaded or failed):
  a request without one would wait forever.
- update_connector_output: blocks the workers failed to load roll the request's "stored" count back to the
  first failed stored block, so those blocks are saved again once vLLM has recomputed them.
- build: for every scheduled request, the stored blocks whose tokens are fully computed after this step and
  not yet saved become a `SaveJob` ("prompt" policy: prompt tokens only; "all": generated ones too).
- request_finished: the request's state goes; its blocks are freed at once (delay_free=False): the worker's
  gather has read them by then (see kvstore_connector/worker.py), and only the Commit of arena slots is pending. The
  exception: with save "all", a request that stopped before max_tokens (EOS, a stop string) has its partial
  last block saved now (kvstore_connector/tails.py), and vLLM keeps its blocks until the worker has gathered that
  block, in the next step.
- tails (kvstore_connector/tails.py): a lookup also asks for the longest stored partial block after its hit keys; the
  hit then ends inside a block, and the load copies that block too. A request's final partial block is saved
  in the step that writes the last of its KV where that step is known (the prompt's last token; with "all",
  the step that samples token max_tokens).
- misses (kvstore_connector/misses.py): a request the store does not fully serve counts one cause, once: the lookup's
  (store down, a failed call, stream mode, or the daemon's reason for the first missing key, asked off this
  thread), else a failed load's.
- hints (kvstore_connector/hints.py): when a request finishes, its session's chain becomes its stored keys and its hints
  (kv_transfer_params' "kvstore_hints", vLLM's Request.kv_hints) are queued for a background thread that sends
  them to every shard namespace.

Tensor parallelism: each TP rank stores its own heads under its own namespace, and the scheduler's stages are
every (pipeline stage, TP rank) shard (vllm_connector.shard_specs): a hit is what every rank can load (TP 8:
8 prefix Lookups per new request, pipelined on the fast path: one round trip plus the daemon's work for each).

Hybrid models (KV cache groups, vLLM's hybrid manager; kvstore_connector/groups.py): every group is a shard of its own,
with its own block table. The hit is the full-attention shards' common prefix, shortened until every
sliding-window or chunked-local shard holds the window vLLM keeps there (one more pipelined probe of those
shards' keys). Loads fill only the blocks vLLM keeps (its null block marks the others); a windowed group saves
only the keys later hits can use (`groups.saved_in_window`) unless window_save is "all".

Requests are read through attribute names vLLM's ``Request`` has (request_id, prompt_token_ids,
all_token_ids, num_computed_tokens, cache_salt, lora_request, mm_features), so tests can drive this class
with a plain object and no vLLM installed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from kvstore_connector.claims import loadable_run, new_claimant
from kvstore_connector.config import ConnectorConfig
from kvstore_connector.groups import NULL_BLOCK, save_points, saved_in_window
from kvstore_connector.hints import HintSessions
from kvstore_connector.key_memo import KeyMemo
from kvstore_connector.keys import KeyChain, chain_root
from kvstore_connector.link import StoreLink
from kvstore_connector.load_policy import LoadPolicy
from kvstore_connector.misses import LOAD_FAILED, STREAM_MODE, UNEXPLAINED, MissExplainer, MissTarget
from kvstore_connector.namespace import KVLayoutSpec, StageLayouts
from kvstore_connector.origins import save_origins
from kvstore_connector.plan import LoadJob, SaveJob, StepPlan
from kvstore_connector.probe import ShardProbe
from kvstore_connector.request_attrs import lora_name, mm_hashes, num_tokens
from kvstore_connector.stats import ConnectorCounters
from kvstore_connector.request_state import ReqState, ScheduledRequest
from kvstore_connector.scheduler_tails import SchedulerTails
from kvstore.engine.claims import CLAIMED
from kvstore.vocab import Tier

__all__ = ["SchedulerSide", "ScheduledRequest"]

log = logging.getLogger(__name__)


class SchedulerSide(SchedulerTails):
    def __init__(self, config: ConnectorConfig, spec: KVLayoutSpec, link: StoreLink,
                 counters: ConnectorCounters | None = None, *, stages: StageLayouts | None = None,
                 key_memo: KeyMemo | None = None) -> None:
        """``stages``: every pipeline stage's layout (default: ``spec`` alone, no pipeline parallelism).
        ``key_memo``: keys found by vLLM's block hashes (kvstore_connector/key_memo.py; None: every request's keys are
        hashed from its first token)."""
        self.config = config
        self.spec = spec
        self.stages = stages or StageLayouts([spec])
        if self.stages.tokens_per_key != spec.tokens_per_key:
            raise ValueError(f"spec stores {spec.tokens_per_key} tokens per key, the stages "
                             f"{self.stages.tokens_per_key}")
        self.link = link
        self.counters = counters or ConnectorCounters()
        self.key_memo = key_memo
        self.tokens_per_key = spec.tokens_per_key
        self.blocks_per_key = spec.blocks_per_key
        # KV cache groups: every shard's group, and each group's kind (the same in every stage and TP rank)
        self._kinds = {s.group_index: s.group_kind for s in self.stages.specs}
        self.num_groups = len(self._kinds)
        self._windowed = [s.group_kind.windowed for s in self.stages.specs]
        self.probe = ShardProbe(self.stages, link, self.counters)
        self.load_policy = LoadPolicy(config, self.stages, self.num_groups)  # in the step or not (load_policy.py)
        self._reqs: dict[str, ReqState] = {}
        self._loads: list[LoadJob] = []
        # partial last blocks (kvstore_connector/tails.py): where a stored block is one vLLM block, one KV cache group
        self.tails = config.tails and self.num_groups == 1 and self.blocks_per_key == 1
        self._tail_saves: list[SaveJob] = []
        self._stream_logged = False
        self.misses = MissExplainer(link, self.counters)
        self.hints = HintSessions(link, self.counters, tokens_per_key=self.tokens_per_key, key_seed=config.key_seed)
        # claims (kvstore_connector/claims.py): where a waiting load can take the place of computing
        self._claims = (config.claim_ms > 0 and config.save != "off" and self.num_groups == 1
                        and config.load_mode != "sync")
        self._claimant = new_claimant()

    # -- state -------------------------------------------------------------------------------------------
    def _state(self, request: Any) -> ReqState:
        st = self._reqs.get(request.request_id)
        if st is None:
            mm = mm_hashes(request)
            root = chain_root(self.config.key_seed, lora_name=lora_name(request), mm_hashes=mm)
            salt = getattr(request, "cache_salt", None) or None
            memo = self.key_memo is not None and not mm and getattr(request, "prompt_embeds", None) is None
            st = ReqState(request, [], salt,
                           KeyChain(self.tokens_per_key, self.config.key_seed, root), root, memo)
            self._reqs[request.request_id] = st
        st.request = request
        return st

    def _names(self, st: ReqState) -> list[str]:
        """The request's shard namespaces for this process's tenant (the daemon names it on connecting: its
        namespaces carry it, kvstore_connector/namespace.py), built again should the tenant change."""
        tenant = self.link.tenant or ""
        if st.names_tenant != tenant:
            st.namespaces, st.names_tenant = self.stages.names(st.salt, tenant), tenant
        return st.namespaces

    def track(self, request: Any) -> None:
        """vLLM's on_new_request: start the request's state (keys are hashed lazily)."""
        self._state(request)

    def _extend(self, st: ReqState, tokens: Sequence[int]) -> list[bytes]:
        """The request's keys of every full chunk of ``tokens`` (KeyChain.extend): a new request's leading keys
        from the key memo where vLLM has hashed their blocks, and the keys hashed here remembered there."""
        memo, chain = self.key_memo, st.chain
        hashes = getattr(st.request, "block_hashes", None) if memo is not None and st.memo else None
        if not hashes or memo is None:
            return chain.extend(tokens)
        if len(hashes) * self.spec.block_size > num_tokens(st.request):
            return chain.extend(tokens)  # hashed in blocks finer than the KV blocks: not for the memo (key_memo.py)
        g = self.blocks_per_key
        if not chain.keys:
            chain.adopt(memo.known(st.root, hashes, g, len(tokens) // self.tokens_per_key))
        start = len(chain.keys)
        keys = chain.extend(tokens)
        if len(keys) > start:
            memo.remember(st.root, hashes, g, keys, start)
        return keys

    @property
    def num_tracked(self) -> int:
        """Requests whose state is kept (between on_new_request and request_finished)."""
        return len(self._reqs)

    # -- lookup ------------------------------------------------------------------------------------------
    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens the store can add beyond vLLM's own prefix cache, load asynchronously?)."""
        if not self.config.load:
            return 0, False
        st = self._state(request)
        prompt = request.prompt_token_ids or []
        # vLLM must compute at least the last prompt token to sample the next one.
        usable = max(0, len(prompt) - 1) // self.tokens_per_key
        if not self._workers_can_load():
            if usable:
                self._missed(st, STREAM_MODE)
            return 0, False
        st.local_tokens = num_computed_tokens
        keys = self._extend(st, prompt)[:usable]
        if st.lookup_keys is None:
            n, tiers, miss = self._lookup(st, keys)
            st.pending_keys = p = self._claim(st, keys, n) if n < len(keys) else 0
            st.fetch_keys = self.load_policy.fetch_keys(tiers, num_computed_tokens)
            if keys:
                self._count_lookup(len(keys), tiers, num_computed_tokens)
            if n + p < len(keys):
                self._missed(st, MissTarget(miss.namespaces, keys[n + p]) if p and isinstance(miss, MissTarget)
                             else miss or UNEXPLAINED)
            st.lookup_keys = n + p
            st.stored_keys = max(st.stored_keys, n + p)
            # no prefix hit: a tail is <1 block; keys still being saved elsewhere: no tail after them yet
            st.lookup_tail = self._find_tail(st, prompt, n) if n and not p else None
        tail = st.lookup_tail.tokens if st.lookup_tail is not None else 0
        hit_tokens = st.lookup_keys * self.tokens_per_key + tail
        extra = hit_tokens - num_computed_tokens
        return (extra, not self._sync(st)) if extra > 0 else (0, False)

    def _sync(self, st: ReqState) -> bool:
        """Load in the step? Never while keys another server computes are awaited (claims.py)."""
        return not st.pending_keys and self.load_policy.sync(st.fetch_keys)

    def _claim(self, st: ReqState, keys: list[bytes], n: int) -> int:
        """Claim the keys from the first miss for this scheduler (kvstore_connector/claims.py); the leading ones
        another claimant is saving (or has saved since the lookup) extend the hit: how many."""
        if not self._claims:
            return 0
        names = self._names(st)
        ms = self.config.claim_ms
        states = self.link.call(names, lambda c: c.claim(names, keys[n:], self._claimant, ms))
        if not states:
            return 0
        p = loadable_run(states)
        self.counters.add(claimed_keys=sum(1 for x in states if x == CLAIMED), claim_pending_keys=p)
        return p

    def _count_lookup(self, asked: int, tiers: list[int], local_tokens: int) -> None:
        """The request's prompt tokens by where they would come from: vLLM's own prefix cache first, then the
        store's RAM, disk and peer tiers (the farthest shard's tier), the rest computed."""
        t = self.tokens_per_key
        beyond = tiers[min(len(tiers), local_tokens // t):]
        self.counters.add(lookup_tokens=asked * t, hit_tokens=len(tiers) * t, served_tokens_vllm=local_tokens,
                          served_tokens_ram=t * sum(1 for x in beyond if x == Tier.RAM),
                          served_tokens_disk=t * sum(1 for x in beyond if x == Tier.DISK),
                          served_tokens_peer=t * sum(1 for x in beyond if x == Tier.PEER))

    def _missed(self, st: ReqState, cause: str | MissTarget) -> None:
        """The request's first miss: counted now (a cause known here) or once the daemon has explained it."""
        if not st.missed:
            st.missed = True
            rid = st.request.request_id
            self.misses.count(rid, cause) if isinstance(cause, str) else self.misses.submit(rid, cause)

    def _lookup(self, st: ReqState, keys: list[bytes]) -> tuple[int, list[int], str | MissTarget | None]:
        """The request's prefix across every shard (kvstore_connector/probe.py): the hit, its tiers, why it stopped."""
        return self.probe.lookup(self._names(st), keys)

    def _workers_can_load(self) -> bool:
        """False when this process reaches the daemon only by streaming gRPC: the daemon's arena cannot be
        mapped here, so (same node, same permissions) the workers cannot map it either and every load would
        fail. A store that is down answers no hits through the link anyway."""
        c = self.link.client
        if c is None or c.mode == "arena":
            return True
        self.counters.add(lookup_skipped_stream=1)
        if not self._stream_logged:
            self._stream_logged = True
            log.error("kvstore connector: the daemon at %s is reachable but its arena cannot be mapped by this "
                      "process (daemon on another host, or no access to its shared memory); offering no hits, "
                      "since the workers load only through the arena. Run kvstore-server on this node with "
                      "access for vLLM's user.", c.address)
        return False

    def after_alloc(self, request: Any, block_ids: list[list[int]], num_external_tokens: int) -> None:
        """Blocks are allocated; when the store supplies tokens, plan their load into ``block_ids``.

        Always queues a job when ``num_external_tokens`` > 0: an asynchronous load put the request in
        WAITING_FOR_REMOTE_KVS and only the worker's report (loaded or failed) takes it out; a synchronous
        one is scheduled in this step and must find its blocks loaded when the forward runs."""
        st = self._state(request)
        if num_external_tokens <= 0:
            return
        tail, st.lookup_tail = st.lookup_tail, None
        st.lookup_keys = None  # used: if this load fails and vLLM asks again, look again
        t = self.tokens_per_key
        local = st.local_tokens
        end = local + num_external_tokens
        first_key = local // t
        # Our hits end on a key boundary or inside a stored tail (kvstore_connector/tails.py); were one cut inside a
        # key, its whole key is loaded and vLLM recomputes (overwrites) the positions past ``end``.
        last_key = -(-end // t)
        keys = self._extend(st, request.prompt_token_ids or [])[first_key:last_key]
        if tail is not None and end == tail.full * t + tail.tokens and first_key <= tail.full:
            keys = keys[:tail.full - first_key] + [tail.key]  # the tail's block holds the partial key's tokens
        allocated = min((len(b) for b in block_ids), default=0)
        if len(keys) != last_key - first_key or allocated < -(-end // self.spec.block_size):
            log.error("request %s: vLLM expects %d tokens from the store after %d of its own, beyond the %d keys "
                      "looked up or the %d blocks allocated; loading what fits", request.request_id,
                      num_external_tokens, local, len(st.chain.keys), allocated)
            last_key = first_key + len(keys)
        st.load_skip_blocks = (local - first_key * t) // self.spec.block_size
        blocks = [self._load_blocks(gi, block_ids[gi], first_key, last_key, st.load_skip_blocks)
                  for gi in range(len(block_ids))]
        st.block_ids = [list(b) for b in block_ids]
        st.loading = (first_key, blocks)
        sync = self._sync(st)
        st.sync_builds = 2 if sync else 0
        wait_s = self.config.claim_ms / 1000.0 if st.pending_keys else 0.0
        st.pending_keys = 0
        self._loads.append(LoadJob(request.request_id, st.salt, list(keys), blocks, sync, wait_s))
        self.counters.add(load_requests=1, load_sync_requests=int(sync),
                          load_sync_fetch_requests=int(sync and st.fetch_keys > 0))

    def _load_blocks(self, group: int, table: list[int], first_key: int, last_key: int, skip: int) -> list[int]:
        """One group's blocks for the keys first_key .. last_key-1: -1 where the worker must not write (blocks
        of vLLM's own prefix-cache hit, and in a windowed group the null blocks vLLM does not keep)."""
        g = self.blocks_per_key
        blocks = list(table[first_key * g: last_key * g])
        blocks += [-1] * ((last_key - first_key) * g - len(blocks))
        for i in range(skip):
            blocks[i] = -1
        if self._kinds.get(group, self.spec.group_kind).windowed:
            blocks = [-1 if b == NULL_BLOCK else b for b in blocks]
        return blocks

    def on_worker_output(self, finished_recving: Iterable[str], invalid_block_ids: Iterable[int],
                         failed_recving: Iterable[str] = ()) -> None:
        """vLLM's update_connector_output: blocks that failed to load are not in the store (evicted since the
        lookup, a restarted daemon, a lost lease): roll the request's stored count back to the stored block
        that holds the first of them, so that block and the ones after it are saved again once vLLM has
        recomputed them (keys the store still has are skipped by the daemon's Reserve). A request whose load
        failed as a whole (``failed_recving``: models with several KV cache groups) rolls back to its load's
        first key: vLLM recomputes all of it."""
        for rid in failed_recving:
            st = self._reqs.get(rid)
            if st is not None and st.loading is not None:
                self._missed(st, LOAD_FAILED)
            if st is not None and st.loading is not None and st.loading[0] < st.stored_keys:
                self.counters.add(load_rollback_keys=st.stored_keys - st.loading[0])
                st.stored_keys = st.loading[0]
        invalid = set(invalid_block_ids)
        g = self.blocks_per_key
        if invalid:
            for st in self._reqs.values():
                if st.loading is None:
                    continue
                first_key, groups = st.loading
                bad = min((i for blocks in groups for i, b in enumerate(blocks) if b >= 0 and b in invalid),
                          default=None)
                if bad is not None:
                    self._missed(st, LOAD_FAILED)
                if bad is not None and first_key + bad // g < st.stored_keys:
                    self.counters.add(load_rollback_keys=st.stored_keys - (first_key + bad // g))
                    st.stored_keys = first_key + bad // g
        for rid in finished_recving:
            done = self._reqs.get(rid)
            if done is not None:
                done.loading = None

    # -- per step ----------------------------------------------------------------------------------------
    def build(self, scheduled: Iterable[ScheduledRequest], finished_req_ids: Iterable[str] = ()) -> StepPlan:
        plan = StepPlan(loads=self._loads, saves=self._tail_saves)
        self._loads, self._tail_saves = [], []
        for s in scheduled:
            st = self._reqs.get(s.req_id)
            if st is None:
                continue
            st.lookup_keys = None  # scheduled: a later re-lookup (after preemption) must ask again
            if st.sync_builds:     # a synchronous load's failures are reported after its step
                st.sync_builds -= 1
            else:
                st.loading = None  # a scheduled request's asynchronous load has been reported
            if s.block_ids is not None:
                if s.is_full_table or not st.block_ids:
                    st.block_ids = [list(b) for b in s.block_ids]
                else:
                    for table, new in zip(st.block_ids, s.block_ids):
                        table.extend(new)
            job = self._save_job(st, s.num_scheduled_tokens, s.is_full_table and s.block_ids is not None)
            if job is not None:
                plan.saves.append(job)
            tail = self._final_tail(st, s.num_scheduled_tokens)
            if tail is not None:
                plan.saves.append(tail)
        for rid in finished_req_ids:
            self._reqs.pop(rid, None)
        return plan

    def _save_job(self, st: ReqState, num_scheduled_tokens: int, fresh_table: bool) -> SaveJob | None:
        """``fresh_table``: this step's output carried the request's whole block tables (a new or resumed request);
        otherwise a windowed group's entries for tokens computed in earlier steps may name blocks vLLM has handed
        back since (it does not tell the connector), and only keys this step completes are saved there."""
        if self.config.save == "off":
            return None
        req = st.request
        tokens = req.all_token_ids if self.config.save == "all" else req.prompt_token_ids
        computed = min(req.num_computed_tokens + num_scheduled_tokens, len(tokens))
        g = self.blocks_per_key
        full = min(computed // self.tokens_per_key, min((len(b) for b in st.block_ids), default=0) // g)
        if full <= st.stored_keys:
            return None
        keys = self._extend(st, tokens[: full * self.tokens_per_key])[st.stored_keys:full]
        first = st.stored_keys
        live = 0 if fresh_table else req.num_computed_tokens // self.tokens_per_key
        blocks = [self._save_blocks(gi, table, first, full, len(req.prompt_token_ids or ()), live)
                  for gi, table in enumerate(st.block_ids)]
        st.stored_keys = full
        self.counters.add(save_keys=full - first)
        origins = (save_origins(req, tokens, first, full, g, self.spec.block_size)
                   if self.num_groups == 1 and self._daemon_publishes() else ())
        return SaveJob(req.request_id, st.salt, list(keys), blocks, origins=origins)

    def _daemon_publishes(self) -> bool:
        """Whether the daemon publishes vLLM-format KV events (said when the link connected): only then are the
        saved keys' vLLM identities worth building and sending (kvstore_connector/origins.py)."""
        c = self.link.client
        return c is not None and c.kv_events

    def _save_blocks(self, group: int, table: list[int], first: int, full: int, prompt_len: int,
                     live: int) -> list[int]:
        """One group's blocks for the keys first .. full-1. A windowed group keeps (window_save "trim") only the
        keys a later hit can use (groups.saved_in_window: the window before the prompt's end and before every
        checkpoint; with save "all", every key past the prompt too), never a key holding a null block (vLLM
        handed it back before this save: its bytes are not this request's) and none before key ``live`` (its
        table entries may be stale); the others are -1."""
        g, t = self.blocks_per_key, self.tokens_per_key
        blocks = list(table[first * g: full * g])
        kind = self._kinds.get(group, self.spec.group_kind)
        if not kind.windowed:
            return blocks
        points = save_points(prompt_len, t, self.config.window_checkpoint_tokens)
        trim = self.config.window_save == "trim"
        for k in range(first, full):
            part = blocks[(k - first) * g:(k - first + 1) * g]
            keep = k >= live and NULL_BLOCK not in part and (not trim or (k + 1) * t > prompt_len or saved_in_window(
                kind, k, tokens_per_key=t, block_size=self.spec.block_size, save_points=points))
            if not keep:
                blocks[(k - first) * g:(k - first + 1) * g] = [-1] * g
        return blocks

    def request_finished(self, request: Any, block_ids: Sequence[int] | None = None) -> bool:
        """Whether vLLM must keep the request's blocks: only while a partial last block that could not be saved
        in its last step waits for the worker's gather (kvstore_connector/tails.py; ``block_ids``: vLLM's blocks of its
        computed tokens, group 0). Drops its state and queues its hints (kvstore_connector/hints.py)."""
        st = self._reqs.pop(request.request_id, None) or self._state(request)
        self._reqs.pop(request.request_id, None)
        self.hints.finished(request, self._names(st), st.chain.keys[:st.stored_keys], st.root)
        return self._tail_after_finish(st, block_ids)
