"""vLLM's real v1 Scheduler with a hybrid KV cache (several KV cache groups, hybrid manager on), on CPU.

A 4-layer model: layers 0 and 2 full attention, layers 1 and 3 sliding-window (a Gemma-3-style config.json,
window 48 tokens = 3 blocks) or chunked local attention (a Llama-4-style one, chunks of 64 tokens). The KV cache
config is built by vLLM's own planner (get_kv_cache_groups, get_kv_cache_config_from_groups) and the worker's
tensors by vLLM's own allocate_kv_cache, as a GPU worker does: two groups of two layers that overlay one backing
allocation (layer 0 and layer 1 are views of the same bytes; a block id belongs to one group at a time), each
layer viewed as (blocks, heads, block_size, K and V) in the LBHNC layout (the only one vLLM's CPU backend takes).

This machine's platform does not support vLLM's hybrid manager, so the harness lets VllmConfig decide as it does
on a CUDA platform; vLLM then keeps the manager on only because the connector declares SupportsHMA (a test
asserts it). `step` is `Harness.step` except that the worker's output is built as vLLM 0.33's model runner
builds it (kv_connector_model_runner_mixin): finished and failed receives from get_transfer_results, failed
blocks from get_block_ids_with_load_errors. With several KV cache groups vLLM accepts a failed load only as a
failed receive of the request (block ids repeat across groups); a reported block id raises in the Scheduler.

The fake forward writes, per group, into that group's block table (the scheduler output's block_ids[g]) for that
group's layers only, the value of harness.kv_value for (layer, K/V, position, token) and skips positions whose
block is vLLM's null block (id 0): vLLM hands a sliding window's old blocks back and never gives the null block a
computed token. `kept_match` checks that the blocks vLLM keeps for a request hold what a forward writes.
"""

from __future__ import annotations

import json
import os
from typing import Any
from unittest import mock

import torch

from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.platforms import current_platform
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from kvstore_connector.vllm_connector import KVStoreConnector

from .harness import BLOCK, HEAD_DIM, HEADS, NUM_BLOCKS, SAMPLED, Harness, kv_value

__all__ = ["CHUNK", "WINDOW", "HybridHarness", "LAYER_NAMES", "block_value", "skipped_tokens",
           "write_hybrid_model_config"]

LAYERS = 4
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
FULL_LAYERS, LOCAL_LAYERS = (0, 2), (1, 3)
WINDOW = 48   # sliding window, tokens (3 blocks)
CHUNK = 64    # chunked local attention, tokens (4 blocks)
NULL = 0      # vLLM's null block
LAYOUT = "LBHNC"


def write_hybrid_model_config(path: str, local: str) -> str:
    """config.json of a tiny Gemma-3-style (local="sliding") or Llama-4-style (local="chunked") model; vLLM reads
    only the config (no weights, no tokenizer)."""
    common = {"hidden_size": HEADS * 2 * HEAD_DIM, "intermediate_size": 512, "num_attention_heads": HEADS * 2,
              "num_key_value_heads": HEADS, "num_hidden_layers": LAYERS, "vocab_size": 1024,
              "max_position_embeddings": 4096, "torch_dtype": "float32", "head_dim": HEAD_DIM, "bos_token_id": 1,
              "eos_token_id": 2}
    if local == "sliding":
        cfg = {**common, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "rms_norm_eps": 1e-6,
               "sliding_window": WINDOW, "query_pre_attn_scalar": HEAD_DIM, "pad_token_id": 0,
               "layer_types": ["sliding_attention" if i in LOCAL_LAYERS else "full_attention"
                               for i in range(LAYERS)]}
    elif local == "chunked":  # no_rope_layers: 0 = a global NoPE layer, 1 = a chunked local RoPE layer
        cfg = {**common, "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "rms_norm_eps": 1e-5,
               "attention_chunk_size": CHUNK, "no_rope_layers": [int(i in LOCAL_LAYERS) for i in range(LAYERS)],
               "intermediate_size_mlp": 512, "num_local_experts": 1, "num_experts_per_tok": 1,
               "interleave_moe_layer_step": 1, "moe_layers": []}
    else:
        raise ValueError(f"local={local!r}: 'sliding' or 'chunked'")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def skipped_tokens(local: str, computed: int) -> int:
    """vLLM's get_num_skipped_tokens of the local group (SlidingWindowManager / ChunkedLocalAttentionManager)."""
    if local == "sliding":
        return max(0, computed - WINDOW + 1)
    return computed // CHUNK * CHUNK


def block_value(layer: int, pos: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """What a forward writes for ``pos``/``tok`` (n,) into one layer's view: (n, heads, K then V)."""
    k = kv_value(layer, 0, pos, tok)[:, None, None].expand(-1, HEADS, HEAD_DIM)
    v = kv_value(layer, 1, pos, tok)[:, None, None].expand(-1, HEADS, HEAD_DIM)
    return torch.cat([k, v], dim=2)


class HybridHarness(Harness):
    """`Harness` with a two-group KV cache: group 0 full attention (layers 0, 2), group 1 ``local`` ("sliding" or
    "chunked": layers 1, 3). One worker (no PP/TP)."""

    def __init__(self, model_dir: str, address: str, *, local: str = "sliding",
                 extra: dict[str, Any] | None = None, policy: str | None = "recompute") -> None:
        self.local = local
        mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=4096)
        sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=4096,
                             async_scheduling=False, is_encoder_decoder=False)
        cc = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
        kv = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore_connector.vllm_connector",
                              kv_role="kv_both",
                              kv_connector_extra_config={"address": address, "load_mode": "async", **(extra or {})},
                              **({"kv_load_failure_policy": policy} if policy is not None else {}))
        # decide as on a CUDA platform (this CPU-only one never supports the hybrid manager); chunked local
        # attention needs vLLM's opt-in to keep it on
        env = {"VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": "1"}
        with mock.patch.object(type(current_platform), "support_hybrid_kv_cache", classmethod(lambda cls: True)), \
                mock.patch.dict(os.environ, env):
            self.vllm_config = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc,
                                          kv_transfer_config=kv, device_config=DeviceConfig("cpu"))
        self.vllm_config.cache_config.kv_cache_layout = LAYOUT
        self.vllm_config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
        self.vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
        full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32)
        if local == "sliding":
            loc: Any = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM,
                                         dtype=torch.float32, sliding_window=WINDOW)
        else:
            loc = ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM,
                                            dtype=torch.float32, attention_chunk_size=CHUNK)
        specs = {n: (loc if i in LOCAL_LAYERS else full) for i, n in enumerate(LAYER_NAMES)}
        groups = get_kv_cache_groups(self.vllm_config, specs)
        self.kv_cache_config = get_kv_cache_config_from_groups(self.vllm_config, groups, 1 << 40)
        assert self.kv_cache_config.num_blocks == NUM_BLOCKS
        self.group_layers = [[LAYER_NAMES.index(n) for n in g.layer_names] for g in groups]
        self.scheduler = Scheduler(vllm_config=self.vllm_config,
                                   kv_cache_config=generate_scheduler_kv_cache_config([self.kv_cache_config]),
                                   structured_output_manager=StructuredOutputManager(self.vllm_config),
                                   block_size=BLOCK, log_stats=True)
        assert isinstance(self.scheduler.connector, KVStoreConnector)
        w = KVStoreConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.kv_caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"),
                                           self.vllm_config.cache_config.get_resolved_kv_cache_layout())
        w.register_kv_caches(self.kv_caches)
        self.workers = [w]
        self.worker = w
        self.caches = []
        self._aggregator = KVOutputAggregator(1)
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BLOCK, sha256)
        self.tracked = {}
        self.steps: list[SchedulerOutput] = []
        self.prefill = {}
        self.before_worker = None
        self.finish_reasons = {}
        self.load_jobs = []
        self._loading = set()
        self.scheduler_stats = []
        self.tables: dict[str, list[list[int]]] = {}  # request -> per group, the block table the worker saw
        self.kept: dict[str, list[list[int]]] = {}    # request -> per group, vLLM's blocks at its last step

    @property
    def coordinator_name(self) -> str:
        return type(self.scheduler.kv_cache_manager.coordinator).__name__

    def vllm_blocks(self, rid: str) -> list[list[int]]:
        """vLLM's block table of ``rid`` now, per group (NULL where a local group has handed a block back)."""
        return [[b.block_id for b in m.req_to_blocks.get(rid, ())]
                for m in self.scheduler.kv_cache_manager.coordinator.single_type_managers]

    def _forward(self, out: SchedulerOutput) -> dict[str, list[int]]:
        ngroups = len(self.group_layers)
        for r in out.scheduled_new_reqs:
            self.tables[r.req_id] = [list(b) for b in r.block_ids]
        c = out.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            nb = c.new_block_ids[i]
            if rid in c.resumed_req_ids:
                self.tables[rid] = [list(b) for b in nb] if nb else [[] for _ in range(ngroups)]
            elif nb:
                for table, new in zip(self.tables[rid], nb):
                    table.extend(new)
        sampled: dict[str, list[int]] = {}
        for rid, n in out.num_scheduled_tokens.items():
            t = self.tracked[rid]
            self.kept[rid] = self.vllm_blocks(rid)
            start = t.req.num_computed_tokens - n  # the scheduler already advanced it
            pos = torch.arange(start, start + n)
            toks = torch.tensor(t.req.all_token_ids[start:start + n])
            for g, layers in enumerate(self.group_layers):
                table = self.tables[rid][g]
                assert len(table) * BLOCK >= start + n, f"{rid} group {g}: {len(table)} blocks for {start + n} tokens"
                blk = torch.tensor([table[p // BLOCK] for p in pos.tolist()], dtype=torch.long)
                live = blk != NULL
                for layer in layers:
                    view = self.kv_caches[LAYER_NAMES[layer]]
                    view[blk[live], :, (pos % BLOCK)[live]] = block_value(layer, pos[live], toks[live])
            t.scheduled_tokens += n
            sampled[rid] = [SAMPLED] if start + n >= t.req.num_prompt_tokens else []
        return sampled

    def kept_match(self, rid: str, upto: int) -> list[list[int]]:
        """Checks that every block vLLM kept for ``rid`` at its last step (non-null) holds, for its positions
        below ``upto``, exactly what the forward writes in each group's layers; returns the kept block indices of
        every group (so a test can compare them with vLLM's window rule)."""
        t = self.tracked[rid]
        kept = []
        for g, layers in enumerate(self.group_layers):
            table = self.kept[rid][g]
            idx = [i for i, b in enumerate(table) if b != NULL and i * BLOCK < upto]
            kept.append(idx)
            pos = torch.tensor([p for i in idx for p in range(i * BLOCK, min((i + 1) * BLOCK, upto))],
                               dtype=torch.long)
            toks = torch.tensor(t.req.all_token_ids[:upto])[pos]
            blk = torch.tensor([table[p // BLOCK] for p in pos.tolist()], dtype=torch.long)
            for layer in layers:
                got = self.kv_caches[LAYER_NAMES[layer]][blk, :, pos % BLOCK]
                want = block_value(layer, pos, toks)
                assert torch.equal(got, want), (
                    f"{rid} group {g} layer {layer}: positions "
                    f"{sorted({int(p) for p in pos[(got != want).flatten(1).any(1)]})[:8]}... differ")
        return kept

    def key_bytes(self, tokens: list[int], key: int, group: int) -> bytes:
        """One stored block (blocks_per_key=1) of ``group`` as a forward writes it: per layer of the group,
        that block's (heads, block_size, K and V) page."""
        pos = torch.arange(key * BLOCK, (key + 1) * BLOCK)
        tok = torch.tensor(tokens[key * BLOCK:(key + 1) * BLOCK])
        return b"".join(block_value(li, pos, tok).transpose(0, 1).contiguous().numpy().tobytes()
                        for li in self.group_layers[group])
