"""vLLM's real v1 Scheduler with KVStoreConnector for an MLA model (DeepSeek-V2 style), on CPU, no weights.

An MLA layer caches one latent vector per token (the compressed KV, ``kv_lora_rank`` wide, plus the rotary part,
``qk_rope_head_dim``), not K and V per head: vLLM's MLA backends register one tensor per layer shaped
(num_blocks, block_size, kv_lora_rank + qk_rope_head_dim), and the KV cache group's spec is an
MLAAttentionSpec with one KV head, whose page size has no factor 2 for K and V.

`MLAHarness` reuses tests/vllm_sched/harness.py's step loop (schedule -> workers' load -> forward -> save ->
vLLM's aggregator -> update_from_output) and replaces only the model and the caches: the fake forward writes a
latent that is a pure function of (layer, position, token).
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import torch

from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                         VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec
from vllm.v1.structured_output import StructuredOutputManager

from kvstore_connector.vllm_connector import KVStoreConnector

from .harness import BLOCK, Harness

__all__ = ["KV_LORA_RANK", "ROPE_DIM", "LATENT", "MLA_LAYERS", "MLA_NUM_BLOCKS", "MLAHarness", "latent_value",
           "write_mla_config"]

KV_LORA_RANK, ROPE_DIM, MLA_LAYERS, MLA_NUM_BLOCKS = 64, 16, 2, 128
LATENT = KV_LORA_RANK + ROPE_DIM   # vLLM's head size of an MLA layer
MLA_LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(MLA_LAYERS)]
_SIGNS = torch.tensor([1.0 if j % 2 == 0 else -1.0 for j in range(LATENT)])  # columns differ, still exact


def write_mla_config(path: str) -> str:
    """A tiny DeepSeek-V2 config.json (2 layers, a 64-wide latent, 16 rotary dims); no weights, no tokenizer."""
    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 256,
           "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": MLA_LAYERS,
           "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": KV_LORA_RANK, "q_lora_rank": None,
           "qk_nope_head_dim": 32, "qk_rope_head_dim": ROPE_DIM, "v_head_dim": 32, "n_routed_experts": 4,
           "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
           "n_group": 1, "topk_group": 1, "topk_method": "greedy", "routed_scaling_factor": 1.0,
           "scoring_func": "softmax", "norm_topk_prob": False, "vocab_size": 1024, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "float32", "bos_token_id": 1,
           "eos_token_id": 2, "tie_word_embeddings": False}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def latent_value(layer: int, pos: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """(tokens, LATENT): what the fake forward caches for (layer, position, token); exact in float32."""
    return ((tok.float() * 4096 + pos.float()) * 2 + layer)[:, None] * _SIGNS


class MLAHarness(Harness):
    """One scheduler and one worker per TP rank (``tp``; no PP): the MLA model's one KV cache group. As in vLLM,
    every rank caches the same latents (MLA's KV is not split across TP ranks: max_tp_shards=1)."""

    def __init__(self, model_dir: str, address: str, *, extra: dict[str, Any] | None = None,  # noqa: PLW0231
                 tp: int = 1, prefix_caching: bool = True) -> None:
        # Harness.__init__ builds a Llama with K and V caches; this one builds the same rig for MLA
        mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=4096)
        sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=4096,
                             async_scheduling=False, is_encoder_decoder=False)
        kv = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore_connector.vllm_connector",
                              kv_role="kv_both", kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"address": address, "load_mode": "async", "tails": False,
                                                         **(extra or {})})
        self.vllm_config = VllmConfig(model_config=mc, scheduler_config=sc,
                                      cache_config=CacheConfig(block_size=BLOCK,
                                                               enable_prefix_caching=prefix_caching),
                                      kv_transfer_config=kv, device_config=DeviceConfig("cpu"),
                                      parallel_config=ParallelConfig(tensor_parallel_size=tp))
        self.vllm_config.cache_config.num_gpu_blocks = MLA_NUM_BLOCKS
        self.mla_spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=LATENT, dtype=torch.float32,
                                         max_tp_shards=1)  # as vLLM's MLA layers declare it
        kcc = KVCacheConfig(num_blocks=MLA_NUM_BLOCKS, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec(MLA_LAYER_NAMES, self.mla_spec)])
        self.scheduler = Scheduler(vllm_config=self.vllm_config, kv_cache_config=kcc,
                                   structured_output_manager=StructuredOutputManager(self.vllm_config),
                                   block_size=BLOCK, log_stats=True)
        assert isinstance(self.scheduler.connector, KVStoreConnector)
        self.rank_latents: list[dict[str, torch.Tensor]] = []
        self.workers = []
        for rank in range(tp):
            cfg = self.vllm_config
            if tp > 1:
                cfg = copy.deepcopy(self.vllm_config)  # each worker process has its own config, rank set
                cfg.parallel_config.rank = rank
            w = KVStoreConnector(cfg, KVConnectorRole.WORKER, kcc)
            # as vLLM's MLA backends allocate them: (num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)
            latents = {n: torch.zeros(MLA_NUM_BLOCKS, BLOCK, LATENT) for n in MLA_LAYER_NAMES}
            w.register_kv_caches(latents)
            self.rank_latents.append(latents)
            self.workers.append(w)
        self.latents = self.rank_latents[0]
        self.caches = []  # the base forward writes no K/V; _forward below writes the latents
        self.worker = self.workers[0]
        self._aggregator = KVOutputAggregator(tp)
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BLOCK, sha256)
        self.tracked = {}
        self.steps = []
        self.prefill = {}
        self.before_worker = None
        self.finish_reasons = {}
        self.load_jobs = []
        self._loading = set()
        self.scheduler_stats = []

    def _forward(self, out: SchedulerOutput) -> dict[str, list[int]]:
        sampled = super()._forward(out)  # block tables and sampling (no K/V caches to write)
        for rid, n in out.num_scheduled_tokens.items():
            t = self.tracked[rid]
            start = t.req.num_computed_tokens - n
            pos = torch.arange(start, start + n)
            blk = torch.tensor([t.blocks[p // BLOCK] for p in pos.tolist()])
            toks = torch.tensor(t.req.all_token_ids[start:start + n])
            for latents in self.rank_latents:
                for layer, name in enumerate(MLA_LAYER_NAMES):
                    latents[name][blk, pos % BLOCK] = latent_value(layer, pos, toks)
        return sampled

    def kv_matches_tokens(self, rid: str, upto: int) -> bool:
        """Blocks of ``rid`` hold, for positions < upto, exactly the latents the fake forward writes."""
        t = self.tracked[rid]
        pos = torch.arange(upto)
        blk = torch.tensor([t.blocks[p // BLOCK] for p in pos.tolist()])
        toks = torch.tensor(t.req.all_token_ids[:upto])
        return all(torch.equal(latents[name][blk, pos % BLOCK], latent_value(layer, pos, toks))
                   for latents in self.rank_latents for layer, name in enumerate(MLA_LAYER_NAMES))
