"""The serving benchmark's report: a table per configuration, two plots (TTFT by turn, TTFT CDF), the
greedy-output check against the reference configuration, and the JSON line with the issue's ratios."""

from __future__ import annotations

import os
import statistics
from typing import Any

from bench._common import print_table
from bench.serve.driver import CallResult, RunResult
from bench.serve.measure import ConfigRun

__all__ = ["summarize", "mismatches", "print_report", "plot", "json_line", "write_calls"]


def _q(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def _tok_s(r: RunResult | None) -> float:
    return r.output_tokens / r.wall_s if r is not None and r.wall_s > 0 else float("nan")


def summarize(c: ConfigRun, bpt: int) -> dict[str, Any]:
    """The configuration's figures; `bpt` = KV bytes per token (turns the store's served bytes into tokens)."""
    calls = c.agentic.calls
    ttft = [x.ttft_s for x in calls]
    prompt = sum(x.prompt_tokens for x in calls)
    cached = sum(x.cached_tokens for x in calls)
    return {"label": c.label, "calls": len(calls), "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": _q(ttft, 0.9),
            "ttft_p99_s": _q(ttft, 0.99), "session_s_mean": statistics.fmean(c.agentic.session_s.values()),
            "agentic_wall_s": c.agentic.wall_s, "output_tok_s": _tok_s(c.saturated),
            "saturated_wall_s": c.saturated.wall_s if c.saturated else float("nan"),
            "saturated_prefill_tokens": (sum(x.prompt_tokens - x.cached_tokens for x in c.saturated.calls)
                                         if c.saturated else None),
            "saturated_queue_s_mean": _mean(c.saturated_vllm, "vllm:request_queue_time_seconds"),
            "saturated_prefill_s_mean": _mean(c.saturated_vllm, "vllm:request_prefill_time_seconds"),
            "preemptions": c.vllm.get("vllm:num_preemptions_total", 0.0)
            + c.saturated_vllm.get("vllm:num_preemptions_total", 0.0),
            "prompt_tokens": prompt, "cached_tokens": cached, "prefill_tokens": prompt - cached,
            "vllm_local_hit_tokens": c.vllm.get("vllm:prefix_cache_hits_total", 0.0),
            "vllm_external_hit_tokens": c.vllm.get("vllm:external_prefix_cache_hits_total", 0.0),
            "queue_s_mean": _mean(c.vllm, "vllm:request_queue_time_seconds"),
            "prefill_s_mean": _mean(c.vllm, "vllm:request_prefill_time_seconds"),
            "store_served_tokens": {(k if k != "peer_tokens" else "from peers"): round(v if k == "peer_tokens" else v / bpt)
                                    for k, v in c.store_served_bytes.items() if v},
            **({"router": c.router} if c.router else {}), **_claims(c.vllm)}


def _claims(counters: dict[str, float]) -> dict[str, Any]:
    """The agentic pass's claims (kvstore_connector/claims.py), every server together; nothing when none moved."""
    got = {name: round(counters.get(f"vllm:kvstore_{name}_total", 0.0), 3) for name in (
        "claimed_keys", "claim_pending_keys", "claim_waits", "claim_waits_served", "claim_wait_missed_keys",
        "claim_wait_seconds")}
    return {"claims": got} if any(got.values()) else {}


def _mean(counters: dict[str, float], histogram: str) -> float | None:
    """A vLLM histogram's mean over the pass (its _sum and _count deltas), None when nothing was recorded."""
    n = counters.get(histogram + "_count", 0.0)
    return counters.get(histogram + "_sum", 0.0) / n if n else None


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def mismatches(ref: RunResult, other: RunResult) -> int:
    """Calls whose greedy output differs from the reference's same call (session, agent, turn)."""
    want = {(x.sid, x.agent, x.turn): x.output_ids for x in ref.calls}
    return sum(1 for x in other.calls if want.get((x.sid, x.agent, x.turn)) != x.output_ids)


def print_report(sums: dict[str, dict[str, Any]], bad: dict[str, int]) -> None:
    rows = []
    for k, s in sums.items():
        hits = ", ".join(f"{t} {int(v)}" for t, v in sorted(s["store_served_tokens"].items())) or "-"
        rows.append((k, s["label"], s["calls"], f"{s['ttft_p50_s']:.3f}", f"{s['ttft_p90_s']:.3f}",
                     f"{s['ttft_p99_s']:.3f}", _s(s["queue_s_mean"]), _s(s["prefill_s_mean"]),
                     f"{s['session_s_mean']:.1f}", f"{s['output_tok_s']:.1f}",
                     s["prefill_tokens"], f"{s['cached_tokens'] / max(1, s['prompt_tokens']):.0%}", hits,
                     bad.get(k, 0)))
    print_table("agent sessions through vLLM's OpenAI server (TTFT: agentic pass; tok/s: saturated pass)",
                ("cfg", "configuration", "calls", "TTFT p50 s", "p90", "p99", "queued s", "prefill s", "session s",
                 "out tok/s", "prefill tok", "cached", "store served tokens", "mismatch"), rows)
    print_table("where the saturated pass's time goes (every session at once, no think time)",
                ("cfg", "wall s", "out tok/s", "prefill tok", "queued s", "prefill s", "preemptions"),
                [(k, f"{s['saturated_wall_s']:.1f}", f"{s['output_tok_s']:.1f}", s["saturated_prefill_tokens"],
                  _s(s["saturated_queue_s_mean"]), _s(s["saturated_prefill_s_mean"]), int(s["preemptions"]))
                 for k, s in sums.items()])


def _by_turn(calls: tuple[CallResult, ...]) -> tuple[list[int], list[float]]:
    turns: dict[int, list[float]] = {}
    for x in calls:
        if x.agent == 0:
            turns.setdefault(x.turn, []).append(x.ttft_s)
    ks = sorted(turns)
    return ks, [statistics.median(turns[k]) for k in ks]


def plot(runs: dict[str, list[ConfigRun]], out_dir: str) -> list[str]:
    """ttft_by_turn.png (median TTFT of the main agents' k-th turn) and ttft_cdf.png, every round's calls of a
    configuration together; the paths written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "serve_ttft_by_turn.png"), os.path.join(out_dir, "serve_ttft_cdf.png")]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, rs in runs.items():
        xs, ys = _by_turn(tuple(x for r in rs for x in r.agentic.calls))
        ax.plot(xs, ys, marker="o", label=f"({k}) {rs[0].label}")
    ax.set(xlabel="turn of the main agent", ylabel="median TTFT (s)", yscale="log",
           title="Time to first token by turn: the context grows, the store keeps it")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, rs in runs.items():
        ttfts = sorted(x.ttft_s for r in rs for x in r.agentic.calls)
        ax.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], where="post", label=f"({k}) {rs[0].label}")
    ax.set(xlabel="TTFT (s)", ylabel="share of calls", xscale="log", title="TTFT distribution, every call")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b != b or a != a or b == 0:
        return None
    return round(a / b, 3)


def json_line(sums: dict[str, dict[str, Any]], bad: dict[str, int], no_reuse: dict[str, Any] | None,
              meta: dict[str, Any]) -> dict[str, Any]:
    def get(k: str, f: str) -> float | None:
        return sums[k][f] if k in sums else None
    p50, tps = "ttft_p50_s", "output_tok_s"
    out: dict[str, Any] = {"bench": "serve", **meta,
                           "ttft_p50_s": {k: round(s[p50], 4) for k, s in sums.items()},
                           "output_tok_s": {k: round(s[tps], 2) for k, s in sums.items()},
                           "ttft_p50_speedup": _ratio(get("a", p50), get("b", p50)),
                           "ttft_p50_speedup_disk": _ratio(get("a", p50), get("c", p50)),
                           "ttft_p50_speedup_peer": _ratio(get("d0", p50), get("d", p50)),
                           "ttft_p50_speedup_routed": _ratio(get("d", p50), get("r", p50)),
                           "prefill_tokens": {k: s["prefill_tokens"] for k, s in sums.items()},
                           "throughput_ratio": _ratio(get("b", tps), get("a", tps)),
                           "ttft_p50_vs_lmcache": _ratio(get("b", p50), get("e", p50)),
                           "throughput_vs_lmcache": _ratio(get("b", tps), get("e", tps)),
                           "ttft_p50_vs_limit": _ratio(get("b", p50), get("f", p50)),
                           "throughput_vs_limit": _ratio(get("b", tps), get("f", tps)),
                           "mismatched_turns": sum(bad.values()), "mismatched_by_config": bad}
    if "a" in sums and "b" in sums:
        out["prefill_tokens_saved_share"] = round(1 - sums["b"]["prefill_tokens"] / max(1, sums["a"]["prefill_tokens"]), 3)
    if no_reuse:
        out["no_reuse_tok_s"] = no_reuse
        ratio = no_reuse.get("paired_ratio", no_reuse["with_connector"] / no_reuse["without"])
        out["zero_reuse_overhead"] = round(1 - ratio, 4)
        if "costs" in no_reuse:  # the same cost measured directly: hook time and daemon CPU over B's time
            out["zero_reuse_hook_share"] = no_reuse["costs"]["hook_share"]
            out["zero_reuse_daemon_cpu_share"] = no_reuse["costs"]["daemon_cpu_share"]
    return out


def write_calls(runs: dict[str, list[ConfigRun]], out_dir: str) -> str:
    """Every call of every configuration, round and pass, one JSON object per line (serve_calls.jsonl): where a
    configuration's time went, call by call (TTFT against cached tokens, server, send time)."""
    import json

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "serve_calls.jsonl")
    with open(path, "w") as f:
        for k, rs in runs.items():
            for rnd, r in enumerate(rs):
                for name, rr in (("agentic", r.agentic), ("saturated", r.saturated)):
                    for x in rr.calls if rr else ():
                        f.write(json.dumps({"config": k, "round": rnd, "pass": name, "session": x.sid,
                                            "agent": x.agent, "turn": x.turn, "server": x.server,
                                            "sent_s": round(x.sent_s, 4),
                                            "ttft_s": round(x.ttft_s, 4), "total_s": round(x.total_s, 4),
                                            "prompt_tokens": x.prompt_tokens,
                                            "cached_tokens": x.cached_tokens}) + "\n")
    return path
