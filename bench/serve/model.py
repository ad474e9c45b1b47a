"""The benchmark's model: a Llama config.json with dummy weights (nothing is downloaded).

Why this shape: prefill must be expensive next to loading the prompt's KV, as it is for a real model on a GPU
(a 70B prefill costs ~1 ms per token; loading its KV from host memory ~0.05 ms). On this machine's CPU a
1024-wide Llama with grouped-query attention (4 KV heads of 128) has the same kind of ratio: its prefill runs
at ~500-2,000 tokens a second while a token's KV is 4 KiB per layer in bf16 (8 in float32). Fewer layers make
a run quicker, and both sides scale with the layer count, but a turn also has fixed costs (HTTP, scheduling, a
decode step): with 4 layers in native bf16 prefill ran at ~2,800 tokens/s and a cached turn's TTFT was half
fixed cost, so bench.serve takes 8 layers where bf16 is native, 4 in float32 (run.default_layers).

The dtype follows the CPU: bf16 where it computes bf16 natively (AVX512-BF16 or AMX), float32 elsewhere. On an
AVX2-only CPU bf16 is emulated: a 2K-token prefill of the 4-layer model took 20 s in bf16 and 3.8 s in float32
on this kind of machine, which turned a quick run into an hour without changing what it shows (KV is twice the
bytes in float32 and still loads in milliseconds).
"""

from __future__ import annotations

import json
import os

__all__ = ["write_model", "kv_bytes_per_token", "cpu_dtype", "DTYPE_BYTES"]

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 1024, 8, 4, 128, 2816, 8192


def write_model(directory: str, layers: int, max_len: int) -> str:
    """Write config.json into `directory` (created) and return the directory."""
    if not 1 <= layers <= 64:
        raise ValueError(f"layers={layers}: use 1..64")
    os.makedirs(directory, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
           "intermediate_size": INTERMEDIATE, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
           "head_dim": HEAD_DIM, "num_hidden_layers": layers, "vocab_size": VOCAB,
           "max_position_embeddings": max(max_len, 4096), "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return directory


def cpu_dtype(cpuinfo: str = "/proc/cpuinfo") -> str:
    """bfloat16 where this CPU has native bf16 arithmetic, else float32 (see the module docstring)."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "bfloat16"
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(flags) else "float32"


def kv_bytes_per_token(layers: int, dtype: str = "bfloat16") -> int:
    """K and V, all KV heads, in the KV cache's dtype (vLLM keeps KV in the model's dtype by default)."""
    return layers * 2 * KV_HEADS * HEAD_DIM * DTYPE_BYTES[dtype]
