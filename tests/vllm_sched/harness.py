"""Drive vLLM's real v1 Scheduler with KVStoreConnector on CPU, with a fake model runner.

vLLM builds the connector itself from the KVTransferConfig (scheduler role, inside the Scheduler); the harness
builds the worker-role instances (one per pipeline stage and TP rank, each with its own global rank in its own
copy of the config, as vLLM's workers have), registers CPU KV caches with vLLM's per-layer layout (2, blocks,
block_size, heads, head_dim) for each stage's layers and each rank's share of the heads, and plays the model runners each step: bind metadata ->
start_load_kv -> "forward" -> wait_for_save -> get_finished -> ModelRunnerOutput per worker -> vLLM's own
KVOutputAggregator (a request is received once every stage reports it) -> Scheduler.update_from_output.

The fake forward writes a KV value that is a pure function of (layer, K/V, position, token), times (TP rank + 1)
so that ranks hold different bytes, and a test can check that blocks vLLM never computed (loaded from the store)
hold exactly what a forward would have written on that rank.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                         VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.utils import get_pp_indices
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvstore_connector.vllm_connector import KVStoreConnector

BLOCK, HEADS, HEAD_DIM, LAYERS, NUM_BLOCKS = 16, 2, 64, 2, 128
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
SAMPLED = 7  # every decode step "samples" this token (never EOS)
STOP = 9  # sampled instead by a request added with stop_after, as its last token (a stop token, as EOS is)


def write_model_config(path: str) -> str:
    import json
    import os

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * 2 * HEAD_DIM,
                   "intermediate_size": 512, "num_attention_heads": HEADS * 2, "num_key_value_heads": HEADS,
                   "num_hidden_layers": LAYERS, "vocab_size": 1024, "max_position_embeddings": 4096,
                   "rms_norm_eps": 1e-5, "torch_dtype": "float32", "head_dim": HEAD_DIM, "bos_token_id": 1,
                   "eos_token_id": 2, "tie_word_embeddings": False}, f)
    return path


def kv_value(layer: int, kv: int, pos: torch.Tensor, tok: torch.Tensor, tp_rank: int = 0) -> torch.Tensor:
    """What the fake forward writes for (layer, K/V, position, token) on TP rank `tp_rank`: exact in float32."""
    return ((tok.float() * 4096 + pos.float()) * 4 + layer * 2 + kv) * (tp_rank + 1)


@dataclass(frozen=True)
class LayerCache:
    """One worker's KV cache of one layer: (2, blocks, block_size, its heads, head_dim)."""

    layer: int
    tp_rank: int
    tensor: torch.Tensor


@dataclass
class Tracked:
    req: Request
    blocks: list[int] = field(default_factory=list)
    scheduled_tokens: int = 0  # tokens the fake model actually computed for this request
    stop_after: int | None = None  # its output token of this number is STOP


class Harness:
    """``pp``: pipeline stages, ``tp``: tensor-parallel ranks (one worker per stage and rank); ``policy``:
    kv_load_failure_policy as the user writes it (None: not written, vLLM's default); ``hash_fn``: vLLM's block
    hash function for the requests (vllm.utils.hashing)."""

    def __init__(self, model_dir: str, address: str, *, extra: dict[str, Any] | None = None, pp: int = 1,
                 tp: int = 1, policy: str | None = "recompute", hash_fn: Any = sha256) -> None:
        mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=4096)
        sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=4096,
                             async_scheduling=False, is_encoder_decoder=False)
        cc = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
        kv = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore_connector.vllm_connector",
                              kv_role="kv_both",
                              # asynchronous loads unless a test asks (most follow WAITING_FOR_REMOTE_KVS);
                              # no partial last blocks unless a test asks (test_vllm_scheduler_tails.py): the
                              # others count stored blocks and steps exactly
                              kv_connector_extra_config={"address": address, "load_mode": "async", "tails": False,
                                                         **(extra or {})},
                              **({"kv_load_failure_policy": policy} if policy is not None else {}))
        self.vllm_config = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc, kv_transfer_config=kv,
                                      device_config=DeviceConfig("cpu"),
                                      parallel_config=ParallelConfig(pipeline_parallel_size=pp,
                                                                     tensor_parallel_size=tp))
        self.vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
        kcc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(LAYER_NAMES, FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS,
                                                            head_size=HEAD_DIM, dtype=torch.float32))])
        self.scheduler = Scheduler(vllm_config=self.vllm_config, kv_cache_config=kcc,
                                   structured_output_manager=StructuredOutputManager(self.vllm_config),
                                   block_size=BLOCK, log_stats=True)
        assert isinstance(self.scheduler.connector, KVStoreConnector)
        self.caches: list[LayerCache] = []
        self.workers: list[KVStoreConnector] = []
        for stage in range(pp):
            for rank in range(tp):
                cfg = self.vllm_config
                if pp * tp > 1:
                    cfg = copy.deepcopy(self.vllm_config)  # each worker process has its own config, rank set
                    cfg.parallel_config.rank = stage * tp + rank  # vLLM's global rank order: DP x PP x TP
                w = KVStoreConnector(cfg, KVConnectorRole.WORKER, kcc)
                start, end = get_pp_indices(LAYERS, stage, pp)
                caches = {n: torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS // tp, HEAD_DIM) for n in LAYER_NAMES[start:end]}
                w.register_kv_caches(caches)
                self.caches += [LayerCache(LAYER_NAMES.index(n), rank, t) for n, t in caches.items()]
                self.workers.append(w)
        self.worker = self.workers[0]
        self._aggregator = KVOutputAggregator(len(self.workers))
        init_none_hash(hash_fn)  # vLLM's prefix-cache hash (sha256_cbor: what a router computes too)
        self._hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.tracked: dict[str, Tracked] = {}
        self.steps: list[SchedulerOutput] = []
        self.prefill: dict[str, Any] = {}  # request id -> vLLM's PrefillStats (local / external cached tokens)
        self.before_worker = None  # hook(scheduler_output): runs between schedule() and the worker step
        self.finish_reasons: dict[str, Any] = {}  # request id -> vLLM's FinishReason
        self.load_jobs: list[tuple[int, str]] = []  # (step, request id) of every load job
        self._loading: set[str] = set()  # requests with a load job not yet reported received
        self.scheduler_stats: list[Any] = []  # vLLM's SchedulerStats of every step, as its stat loggers get them

    @property
    def sched_side(self) -> KVStoreConnector:
        return self.scheduler.connector

    def add(self, rid: str, prompt: list[int], max_tokens: int = 2, stop_after: int | None = None) -> Request:
        """``stop_after``: the request's output token of that number is STOP, a stop token: it stops there,
        before max_tokens (as on EOS)."""
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=[STOP] if stop_after else None)
        req = Request(rid, prompt, sp, None, block_hasher=self._hasher)
        self.scheduler.add_request(req)
        self.tracked[rid] = Tracked(req, stop_after=stop_after)
        return req

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")

    def _waiting_remote(self) -> set[str]:
        return {rid for rid, r in self.scheduler.requests.items() if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS}

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        self.steps.append(out)
        # Only the workers' report takes a request out of WAITING_FOR_REMOTE_KVS: every request there must have
        # a load job not yet reported, or it would wait forever; and one job at a time.
        for job in out.kv_connector_metadata.plan.loads:
            assert job.req_id not in self._loading, f"second load job for {job.req_id}"
            if job.sync:  # scheduled in this very step: vLLM waits for no report
                assert job.req_id in out.num_scheduled_tokens, f"sync load of unscheduled {job.req_id}"
            else:
                self._loading.add(job.req_id)
            self.load_jobs.append((len(self.steps) - 1, job.req_id))
        stranded = self._waiting_remote() - self._loading
        assert not stranded, f"in WAITING_FOR_REMOTE_KVS without a load job: {sorted(stranded)}"
        if self.before_worker is not None:
            self.before_worker(out)
        for w in self.workers:
            w.bind_connector_metadata(out.kv_connector_metadata)
            w.start_load_kv(None)
        sampled = self._forward(out)
        outputs = []
        for w in self.workers:
            w.wait_for_save()
            w._worker.drain()  # make the step deterministic: loads/commits started this step are done
            res = w.get_transfer_results(out.finished_req_ids)  # as vLLM 0.33's model runner asks
            errors = w.get_block_ids_with_load_errors()
            w.clear_connector_metadata()
            ids = list(sampled)
            outputs.append(ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[sampled[r] for r in ids],
                kv_connector_output=KVConnectorOutput(finished_sending=res.finished_sending or None,
                                                      finished_recving=res.finished_recving or None,
                                                      failed_recving=res.failed_recving,
                                                      invalid_block_ids=errors,
                                                      # as vLLM's model runner: this step's worker counters
                                                      kv_connector_stats=w.get_kv_connector_stats())))
        mro = self._aggregator.aggregate(outputs)
        self._loading -= mro.kv_connector_output.finished_recving or set()
        for outs in self.scheduler.update_from_output(out, mro).values():
            if outs.scheduler_stats is not None:
                self.scheduler_stats.append(outs.scheduler_stats)
            for o in outs.outputs:
                if o.prefill_stats is not None:
                    self.prefill[o.request_id] = o.prefill_stats
                if o.finish_reason is not None:
                    self.finish_reasons[o.request_id] = o.finish_reason
        return out

    def _forward(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """Write KV for every scheduled token; sample for requests whose prompt is now fully computed."""
        sampled: dict[str, list[int]] = {}
        for r in out.scheduled_new_reqs:
            self.tracked[r.req_id].blocks = list(r.block_ids[0])
        c = out.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            nb = c.new_block_ids[i]
            if rid in c.resumed_req_ids:
                self.tracked[rid].blocks = list(nb[0]) if nb else []
            elif nb:
                self.tracked[rid].blocks += list(nb[0])
        for rid, n in out.num_scheduled_tokens.items():
            t = self.tracked[rid]
            start = t.req.num_computed_tokens - n  # the scheduler already advanced it
            toks = torch.tensor(t.req.all_token_ids[start:start + n])
            pos = torch.arange(start, start + n)
            blk = torch.tensor([t.blocks[p // BLOCK] for p in pos.tolist()])
            off = pos % BLOCK
            for lc in self.caches:
                for kv in range(2):
                    value = kv_value(lc.layer, kv, pos, toks, lc.tp_rank)[:, None, None]
                    lc.tensor[kv, blk, off] = value.expand(-1, lc.tensor.shape[3], HEAD_DIM)
            t.scheduled_tokens += n
            if start + n >= t.req.num_prompt_tokens:
                last = t.stop_after is not None and len(t.req.output_token_ids) + 1 == t.stop_after
                sampled[rid] = [STOP if last else SAMPLED]
            else:
                sampled[rid] = []
        return sampled

    def kv_matches_tokens(self, rid: str, upto: int) -> bool:
        """Blocks of `rid` hold, for positions < upto, exactly what the fake forward writes."""
        t = self.tracked[rid]
        pos = torch.arange(upto)
        toks = torch.tensor(t.req.all_token_ids[:upto])
        blk = torch.tensor([t.blocks[p // BLOCK] for p in pos.tolist()])
        off = pos % BLOCK
        for lc in self.caches:
            for kv in range(2):
                want = kv_value(lc.layer, kv, pos, toks, lc.tp_rank)[:, None, None]
                if not torch.equal(lc.tensor[kv, blk, off], want.expand(-1, lc.tensor.shape[3], HEAD_DIM)):
                    return False
        return True

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
        self.sched_side.shutdown()
