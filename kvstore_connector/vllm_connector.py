"""`KVStoreConnector`: vLLM's KVConnectorBase_V1 over kvstore-server. A thin facade.

Load it with (installing kvstore registers the class with vLLM: plugin.py; no module path needed)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVStoreConnector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"save": "all"}}'

vLLM builds the class once per role in different processes. The SCHEDULER instance delegates to
`kvstore_connector.scheduler.SchedulerSide` (metadata only), the WORKER instance to `kvstore_connector.worker.WorkerSide`
(bytes); each method here is one line of translation between vLLM's objects and ours. Extra config keys
are documented and validated in `kvstore_connector.config`.

kv_load_failure_policy: vLLM (0.32, 0.33) defaults it to "fail", which ends a request with an error on every
load that fails. For this connector such failures are routine misses (a block evicted between the lookup and
the load, a restarted daemon), so the scheduler-role instance sets it to "recompute" (with a warning) when it
is anything else. vLLM's Scheduler reads the policy from the same KVTransferConfig right after building its
connector, so the change takes effect. Under MultiConnector the Scheduler reads the outer config, which a
child cannot reach: set "kv_load_failure_policy": "recompute" there yourself.

Pipeline parallelism: every stage stores its own layers in its own namespace (kvstore_connector.namespace); the
scheduler looks a prefix up in all of them and offers what every stage holds.

Hybrid models (SupportsHMA): with several KV cache groups (sliding-window or chunked-local layers next to full
ones) vLLM keeps its hybrid KV cache manager on for this connector, so it keeps only the blocks each group's
layers can still attend to. Each group is stored under its own namespace; see kvstore_connector/groups.py.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from kvstore_connector.config import ConnectorConfig
from kvstore_connector.groups import KVGroup, groups_from_config
from kvstore_connector import deprecation
from kvstore_connector.key_memo import KeyMemo
from kvstore_connector.link import StoreLink
from kvstore_connector.namespace import KVLayoutSpec, StageLayouts
from kvstore_connector.plan import StepPlan
from kvstore_connector.prom import KVStorePromMetrics
from kvstore_connector.scheduler import ScheduledRequest, SchedulerSide
from kvstore_connector.stats import ConnectorCounters, miss_summary, timed
from kvstore_connector.vllm_logs import log_where_vllm_logs
from kvstore_connector.worker import WorkerSide
from kvstore.errors import ConfigError
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVStoreConnector", "KVStoreMetadata", "KVStoreStats", "shard_specs", "stage_specs"]

log = logging.getLogger(__name__)



class KVStoreMetadata(KVConnectorMetadata):
    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KVStoreStats(KVConnectorStats):
    """Sums of connector counters over an interval (see kvstore_connector.stats.COUNTER_NAMES)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data)
        if self.data.get("lookup_tokens"):
            out["hit_rate"] = round(self.data.get("hit_tokens", 0) / self.data["lookup_tokens"], 4)
        out.update(miss_summary(self.data))
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _dtype_name(vllm_config: VllmConfig) -> str:
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        return cache_dtype
    return str(vllm_config.model_config.dtype).removeprefix("torch.")


def stage_specs(vllm_config: VllmConfig, config: ConnectorConfig, tp_rank: int,
                groups: Sequence[KVGroup] = (), kv_layout: str = "") -> list[KVLayoutSpec]:
    """The KV layout of every pipeline stage and KV cache group, stage by stage (one without pipeline
    parallelism and hybrid groups); ``groups`` from `kvstore_connector.groups.groups_from_config` (none: one full group).

    Every process derives the same list from the vLLM config: stage s holds the global layers vLLM itself
    gives it (vllm.distributed.utils.get_pp_indices, which honours VLLM_PP_LAYER_PARTITION). Stored blocks
    hold one key's tokens in every stage and group, so ``blocks_per_key`` is resolved once, from the stage with
    the smallest block (every stage's transfer unit reaches min_transfer_bytes, up to the cap). A model with
    one full-attention group keeps the names it had before groups (no group fields in the digest); a hybrid one
    names each group's index, count and kind on the stage's layer range. ``kv_layout``: vLLM's KV cache layout
    (KVCacheConfig.kv_cache_layout, resolved by the engine for every worker): a page's byte order, so two
    layouts never exchange blocks.

    With pipeline parallelism and hybrid groups, ``groups`` is this process's share of the model's groups (the
    scheduler has stage 0's): a group's layer count on another stage is not known here, so it stays out of the
    names (the stage's layer range and the group's index pin its layers) and ``blocks_per_key`` is resolved from
    what every process knows alike, the stage's layers times the page size of one layer (vLLM makes it equal
    across the groups of a hybrid model). The layer count and page bytes of a spec are this process's own.
    """
    from vllm.distributed.utils import get_pp_indices

    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    pp = int(pc.pipeline_parallel_size)
    total = int(mc.get_total_num_hidden_layers())
    common: dict[str, Any] = dict(
        model=config.model_id or str(mc.model), dtype=_dtype_name(vllm_config),
        block_size=int(vllm_config.cache_config.block_size), num_kv_heads=int(mc.get_num_kv_heads(pc)),
        head_dim=int(mc.get_head_size()), tp_rank=tp_rank, tp_size=int(pc.tensor_parallel_size),
        kv_layout=kv_layout)
    hybrid = len(groups) > 1 or any(g.kind.windowed for g in groups)
    bases: list[KVLayoutSpec] = []
    for stage in range(pp):
        start, end = get_pp_indices(total, stage, pp)
        base = KVLayoutSpec(**common, num_layers=end - start, first_layer=start, blocks_per_key=1)
        options: list[KVGroup | None] = [*groups] or [None]
        for g in options:
            spec = _group_spec(base, g, len(groups), hybrid)
            if g is not None:
                shard, shards = g.tp_shard(spec.tp_rank, spec.tp_size)
                spec = replace(spec, tp_rank=shard, tp_size=shards)
            bases.append(spec)
    if hybrid:
        layer_page = max(g.block_bytes // g.num_layers for g in groups if g.num_layers)
        stage_bytes = [b.num_layers * layer_page for b in bases[::len(groups)]]
    else:
        stage_bytes = [b.block_bytes for b in bases]
    k = config.resolve_blocks_per_key(min(stage_bytes))
    return [replace(b, blocks_per_key=k) for b in bases]


def _group_spec(base: KVLayoutSpec, group: KVGroup | None, count: int, hybrid: bool) -> KVLayoutSpec:
    """One stage's spec for one group: a hybrid model's group counts its own layers (vLLM gives each stage the
    same groups); vLLM's page size replaces the K and V formula where they differ (MLA: one latent per token)."""
    if group is None:
        return base
    layers = group.num_layers if hybrid else base.num_layers
    page = group.block_bytes // group.num_layers * layers if group.num_layers and group.block_bytes else 0
    if hybrid:
        return replace(base, kind=group.kind, group_index=group.index, group_count=count, group_layers=layers,
                       page_bytes=page)
    return replace(base, page_bytes=page if page != base.block_bytes else 0)


def _require_layers_in_every_group(groups: Sequence[KVGroup], vllm_config: VllmConfig) -> None:
    """A pipeline stage that holds no layer of a KV cache group (vLLM keeps the group, with no layers) would
    store nothing for it, and every hit needs every group: refuse at startup and say how to avoid it."""
    empty = [g for g in groups if not g.layer_names]
    if empty and len(groups) > 1:
        raise ConfigError(
            f"KVStoreConnector: pipeline stage {_pp_rank(vllm_config)} holds no layer of KV cache group(s) "
            f"{[(g.index, g.kind.describe()) for g in empty]}, so no prefix could ever be loaded on it. Split the "
            "layers so every stage holds layers of every group (VLLM_PP_LAYER_PARTITION), use a smaller "
            "--pipeline-parallel-size, or turn the hybrid KV cache manager off (--disable-hybrid-kv-cache-manager)")


_WIDE_HASHES = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")  # vLLM's block hashes of 128 bits or more


def _key_memo(vllm_config: Any, groups: Sequence[KVGroup]) -> KeyMemo | None:
    """A key memo (kvstore_connector/key_memo.py) where vLLM's block hashes may stand for our keys' prefixes: one KV cache
    group (vLLM then hashes in blocks of at least its KV block; several groups hash finer) and a hash of 128 bits
    or more (as wide as our keys: a collision no likelier than one of theirs). None otherwise."""
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "") or "")
    return KeyMemo() if len(groups) <= 1 and algo in _WIDE_HASHES else None


def _tp_rank(vllm_config: VllmConfig) -> int:
    """This worker's tensor-parallel rank: its rank in vLLM's TP group, or, before the groups exist (tests), the
    one vLLM derives from the worker's global rank (the layout order is DP x PP x TP)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized

    if model_parallel_is_initialized():
        return int(get_tensor_model_parallel_rank())
    pc = vllm_config.parallel_config
    return int(pc.rank) % int(pc.tensor_parallel_size)


def shard_specs(vllm_config: VllmConfig, config: ConnectorConfig, groups: Sequence[KVGroup] = (),
                kv_layout: str = "") -> list[KVLayoutSpec]:
    """Every shard's layout, for the scheduler's lookup: each pipeline stage (and KV cache group) of TP rank 0,
    then of rank 1, ... Each TP rank stores its own heads under its own namespace (the rank is in the digest),
    so a prefix is a hit only when every (stage, rank, group) shard holds it: a rank missing a block would
    otherwise fail its load and make vLLM recompute the whole request. Ranks that hold replicas of one cache
    (MLA: one latent per token, the same on every rank; vLLM's max_tp_shards) share one shard: stored once,
    probed once, loaded by every replica."""
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    every = [s for rank in range(tp) for s in stage_specs(vllm_config, config, rank, groups, kv_layout)]
    return list(dict.fromkeys(every))  # replicas (MLA: every rank holds the same latent) are one shard


def _pp_rank(vllm_config: VllmConfig) -> int:
    """This worker's pipeline stage: its rank in vLLM's PP group, or, before the groups exist (tests), the
    stage vLLM's ModelConfig derives from the worker's global rank (the layout order is DP x PP x TP)."""
    from vllm.distributed.parallel_state import get_pp_group, model_parallel_is_initialized

    if model_parallel_is_initialized():
        return int(get_pp_group().rank_in_group)
    pc = vllm_config.parallel_config
    return (int(pc.rank) // int(pc.tensor_parallel_size)) % int(pc.pipeline_parallel_size)


def _platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _cannot_resume_from_cached_kv(vllm_config: VllmConfig) -> bool:
    """vLLM's CPU platform cannot compute an MLA model on top of cached KV: it turns its own prefix caching off
    for one (unless its AMX MLA kernels run), and a hit loaded from the store would give wrong tokens just the
    same. Same rule here: on CPU, an MLA model whose prefix caching vLLM turned off gets no hits."""
    return (bool(getattr(vllm_config.model_config, "use_mla", False)) and _platform_is_cpu()
            and not vllm_config.cache_config.enable_prefix_caching)


def _recompute_failed_loads(vllm_config: VllmConfig) -> None:
    """Make vLLM recompute blocks that fail to load instead of failing their requests (module docstring)."""
    ktc = vllm_config.kv_transfer_config
    policy = ktc.kv_load_failure_policy
    if policy == "recompute":
        return
    try:
        ktc.kv_load_failure_policy = "recompute"
    except Exception as exc:  # noqa: BLE001 - a config object that refuses the change: say what to write
        raise ConfigError(
            f"KVStoreConnector needs kv_load_failure_policy='recompute' (it is {policy!r}: a block evicted between "
            'lookup and load would fail the request); add "kv_load_failure_policy": "recompute" to '
            "--kv-transfer-config") from exc
    log.warning('kv_load_failure_policy was %r: KVStoreConnector sets it to "recompute" (a block evicted between '
                "lookup and load is a routine miss, not a reason to fail the request). Add "
                '"kv_load_failure_policy": "recompute" to --kv-transfer-config to silence this warning.', policy)


def _tables(block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
    return [list(b) for b in block_ids]


def _scheduled(out: SchedulerOutput) -> list[ScheduledRequest]:
    """New and cached requests of one step, with their block tables (one per KV cache group)."""
    res = [ScheduledRequest(r.req_id, _tables(r.block_ids), True, out.num_scheduled_tokens.get(r.req_id, 0))
           for r in out.scheduled_new_reqs]
    cached = out.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", None)  # 0.33; older releases: resumed_from_preemption
    flags = ([rid in resumed for rid in cached.req_ids] if resumed is not None
             else list(getattr(cached, "resumed_from_preemption", [False] * len(cached.req_ids))))
    for rid, blocks, full in zip(cached.req_ids, cached.new_block_ids, flags):
        res.append(ScheduledRequest(rid, _tables(blocks) if blocks is not None else None, bool(full),
                                    out.num_scheduled_tokens.get(rid, 0)))
    return res


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        log_where_vllm_logs()
        if deprecation.names_old_path(getattr(vllm_config.kv_transfer_config, "kv_connector_module_path", None)):
            log.warning("%s", deprecation.DEPRECATION)
        self.config = ConnectorConfig.from_extra(vllm_config.kv_transfer_config.kv_connector_extra_config)
        is_sched = role == KVConnectorRole.SCHEDULER
        if is_sched:
            _recompute_failed_loads(vllm_config)
            if self.config.load and _cannot_resume_from_cached_kv(vllm_config):
                log.warning("KVStoreConnector: vLLM cannot compute this MLA model on top of cached KV on CPU (it "
                            "turned its own prefix caching off); offering no hits from the store (saves go on)")
                self.config = replace(self.config, load=False)
        self.groups = groups_from_config(kv_cache_config)
        _require_layers_in_every_group(self.groups, vllm_config)
        layout = str(getattr(kv_cache_config, "kv_cache_layout", None) or "")
        stages = (shard_specs(vllm_config, self.config, self.groups, layout) if is_sched
                  else stage_specs(vllm_config, self.config, _tp_rank(vllm_config), self.groups, layout))
        self.stages = StageLayouts(stages)
        per_stage = len(self.groups)
        first = 0 if is_sched else _pp_rank(vllm_config) * per_stage
        self.spec = stages[first]
        own = stages[first:first + per_stage]  # this worker's stage: one spec per group
        timeout = self.config.lookup_timeout_s if is_sched else self.config.load_timeout_s
        self.counters = ConnectorCounters()
        self.link = StoreLink(self.config.address, timeout_s=timeout, copy_threads=self.config.copy_threads,
                              namespace_spec=self.stages.registration,
                              on_unreachable=lambda: self.counters.add(connect_failures=1))
        self.link.connect()  # now: a daemon nobody can reach is reported at startup, not at the first request
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if is_sched:
            self._sched = SchedulerSide(self.config, self.spec, self.link, self.counters, stages=self.stages,
                                        key_memo=_key_memo(vllm_config, self.groups))
        else:
            self._worker = WorkerSide(self.config, self.spec, self.link, self.counters, group_specs=own,
                                      group_layers=[g.layer_names for g in self.groups])

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    # -- scheduler side ----------------------------------------------------------------------------------
    # Every hook vLLM's threads wait for is timed (kvstore_connector/stats.py: timed): its cost shows in the counters.
    @timed("scheduler_hook_seconds")
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.num_new_matched_tokens(request, num_computed_tokens)

    @timed("scheduler_hook_seconds")
    def on_new_request(self, request: Request) -> None:
        assert self._sched is not None
        self._sched.track(request)

    @timed("scheduler_hook_seconds")
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._sched is not None
        ids = _tables(blocks.get_block_ids()) if num_external_tokens > 0 else []
        self._sched.after_alloc(request, ids, num_external_tokens)

    @timed("scheduler_hook_seconds")
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return KVStoreMetadata(self._sched.build(_scheduled(scheduler_output), scheduler_output.finished_req_ids))

    @timed("scheduler_hook_seconds")
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._sched is not None
        self._sched.on_worker_output(connector_output.finished_recving or (), connector_output.invalid_block_ids,
                                     getattr(connector_output, "failed_recving", None) or ())

    @timed("scheduler_hook_seconds")
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids), None

    @timed("scheduler_hook_seconds")
    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """SupportsHMA's request_finished (vLLM calls this one for a connector that supports HMA)."""
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids[0] if len(block_ids) == 1 else None), None

    @timed("scheduler_hook_seconds")
    def take_events(self) -> Iterable[KVCacheEvent]:
        """None: the store's blocks are published by the daemon itself (kv_events: vLLM's format, vLLM's block
        hashes, a BlockRemoved when a block leaves a tier). The connector used to emit BlockStored here under our
        keys and never a removal: a router could not match those blocks, or routed to blocks that were gone."""
        return ()

    # -- worker side -------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches, self._kv_cache_config.num_blocks)

    @timed("worker_hook_seconds")
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        plan = self._plan()
        self._worker.start_loads(plan.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are whole-request: a synchronous one completed in start_load_kv, an asynchronous
        #              one's request waits in WAITING_FOR_REMOTE_KVS

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # one stored block spans all layers: gathered once in wait_for_save

    @timed("worker_hook_seconds")
    def wait_for_save(self) -> None:
        assert self._worker is not None
        if self.has_connector_metadata():
            self._worker.save(self._plan().saves)

    @timed("worker_hook_seconds")
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        sent, recv = self._worker.finished(set(finished_req_ids))
        return sent or None, recv or None

    @timed("worker_hook_seconds")
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """get_finished, plus the requests whose asynchronous load failed as a whole (models with several KV cache
        groups: vLLM takes no block ids from them; see WorkerSide.transfer_results)."""
        assert self._worker is not None
        sent, recv, failed = self._worker.transfer_results(set(finished_req_ids))
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=recv, failed_recving=failed)

    @timed("worker_hook_seconds")
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors() if self._worker is not None else set()

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreMetadata), type(meta)
        return meta.plan

    # -- both --------------------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data = self.counters.take()
        return KVStoreStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVStoreStats(data=dict(data)) if data is not None else KVStoreStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
                           ) -> KVConnectorPromMetrics | None:
        """The connector's counters on vLLM's /metrics (kvstore_connector/prom.py)."""
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._sched is not None:
            self._sched.hints.close()  # hints queued by finished requests are sent first
            self._sched.misses.close()
        if self._worker is not None:
            self._worker.close()
        self.link.close()
