"""bench.micro at a tiny size: every JSON field exists, every case ran exactly as often as planned, the daemon
counted exactly what the control-plane cases sent, the targets agree with the values (timings are not checked),
and a control case that never reaches the daemon fails the run instead of reporting a number."""

from __future__ import annotations

import json
import operator

import pytest

from bench import control_plane, micro
from kvstore.client import Client
from kvstore.testing import DaemonProcess

MIB = 1 << 20
BUDGET = micro.Budget(warmup=1, min_iters=2, budget_s=0.0, max_iters=2)  # exactly 1 + 2 rounds
TINY = micro.Plan(BUDGET, rss_blocks=4096, arena_bytes=64 * MIB, batches=(1, 4), head_batch=4, stream_batch=2,
                  cold_iters=3, fallback_flush_bytes=4 * MIB)
HOT_CALLS = BUDGET.warmup + BUDGET.min_iters * control_plane.HOT_BLOCK[0]  # per control case: 1 + 2 x 20 = 41
COLD_CALLS = 1 + TINY.cold_iters                                             # 1 warm-up + 3


@pytest.fixture(scope="module")
def report() -> micro.Report:
    r = micro.run(TINY)
    micro.print_report(r)  # the tables render from what run() gathered
    json.dumps(r.out)
    return r


@pytest.fixture
def out(report: micro.Report) -> dict[str, object]:
    return report.out


def test_every_field_of_issue_14_is_reported(out: dict[str, object]) -> None:
    for k in ("uds_rtt_us_p50", "uds_rtt_us_p99", "uds_echo_us_p50", "fast_echo_us_p50", "fast_lookup280_us_p50",
              "fast_lookup280_lease_us_p50", "fast_lookup280_lease_release_us_p50", "grpc_lookup280_us_p50",
              "fast_lookup280_vs_uds", "fast_reserve_commit_us_p50", "grpc_reserve_commit_us_p50",
              "put_256k_gbs", "put_2m_gbs", "get_256k_gbs", "get_2m_gbs", "put_256k_gbs_grpc", "put_2m_gbs_grpc",
              "get_256k_gbs_grpc", "get_2m_gbs_grpc", "arena_put_ratio", "arena_get_ratio", "arena_put_ratio_grpc",
              "arena_get_ratio_grpc", "uds_rtt_us_p50_cold", "fast_lookup280_us_p50_cold", "fast_lookup280_vs_uds_cold",
              "grpc_put_gbs", "grpc_get_gbs", "bytes_per_block", "limit_gbs", "targets", "checks_exact",
              "fast_probe280_us_p50", "fast_probe280_daemon_us_p50", "fast_probe280_vs_uds", "probe_index_vs_daemon",
              "fast_probe280_us_p50_cold", "fast_lookup280_daemon_us_p50", "lookup_index_vs_daemon"):
        assert k in out, k
    for k in ("uds_rtt_us_p50", "fast_echo_us_p50", "fast_lookup280_us_p50", "put_256k_gbs", "arena_get_ratio_grpc"):
        assert isinstance(out[k], float) and out[k] > 0, k
    assert out["fast_lookup280_vs_uds"] == pytest.approx(out["fast_lookup280_us_p50"] / out["uds_rtt_us_p50"], rel=0.01)
    assert out["fast_probe280_vs_uds"] == pytest.approx(out["fast_probe280_us_p50"] / out["uds_rtt_us_p50"], rel=0.01)
    assert out["probe_index_vs_daemon"] == pytest.approx(
        out["fast_probe280_us_p50"] / out["fast_probe280_daemon_us_p50"], rel=0.01)
    assert out["arena_put_ratio"] == pytest.approx(out["arena_put_gbs"] / out["limit_gbs"], rel=0.01)
    assert out["arena_put_ratio_grpc"] == pytest.approx(out["arena_put_gbs_grpc"] / out["limit_gbs"], rel=0.01)
    # the raw socket carries the bytes a 280-key Lookup of 16-byte keys really puts on the wire
    assert (out["uds_request_bytes"], out["uds_reply_bytes"]) == control_plane.lookup_sizes(280)


def test_targets_agree_with_the_values(out: dict[str, object]) -> None:
    targets = out["targets"]
    assert isinstance(targets, dict)
    assert set(targets) == {"fast_lookup280_us_p50", "fast_lookup280_vs_uds", "fast_echo_us_p50", "arena_put_ratio",
                            "arena_get_ratio", "put_2m_gbs", "put_256k_gbs", "bytes_per_block", "fast_probe280_us_p50",
                            "fast_probe280_vs_uds"}
    assert (targets["fast_lookup280_us_p50"]["op"], targets["fast_lookup280_us_p50"]["bound"]) == ("<=", 150)
    assert (targets["put_256k_gbs"]["op"], targets["put_256k_gbs"]["bound"]) == (">=", 1.5)
    cmp = {"<=": operator.le, ">=": operator.ge}
    for k, t in targets.items():
        assert t["value"] == out[k]
        assert t["pass"] == cmp[t["op"]](out[k], t["bound"]), k
        assert out["targets_met"][k] == t["pass"]


def test_every_case_ran_exactly_as_planned(report: micro.Report) -> None:
    out = report.out
    checks = out["checks_exact"]
    calls = checks["control_calls"]
    cold = set(control_plane.COLD)
    assert set(calls) == set(control_plane.EFFECTS)
    for name, n in calls.items():
        assert n == HOT_CALLS + (COLD_CALLS if name in cold else 0), name
    # what the daemon counted over the control section: 9 Lookup cases (5 Lookups, 4 probes; 3 of them cold too)
    # and 2 TP 8 probes of 8 each, 2 Reserve+Commit, and on the fast path: echo 1, lookup 1 (answered from the key index: HITS),
    # lookup with the index off 1, lookup lease 2 (its Release), lease+release 2, reserve+commit 2, probe 1
    # (answered from the key index: a one-way HITS), probe with the index off 1 (a LOOKUP), the same two with 4 new
    # keys after the chain 1 each (the daemon has RAM only, so its index answers the miss too: a HITS), each TP 8
    # probe 8; and the Echo that makes sure the last HITS are counted
    assert checks["lookup_calls"] == (9 + 16) * HOT_CALLS + 3 * COLD_CALLS
    assert checks["reserve_calls"] == checks["committed_blocks"] == 2 * HOT_CALLS
    assert checks["fast_requests"] == (13 + 16) * HOT_CALLS + 3 * COLD_CALLS + 1
    assert out["fast_probe280x8_us_p50"] > 0 and out["fast_probe280x8_seq_us_p50"] > 0
    # the ratio is of the unrounded p50s, the fields are rounded to 0.1 us
    assert out["tp8_probe_vs_seq"] == pytest.approx(out["fast_probe280x8_us_p50"] / out["fast_probe280x8_seq_us_p50"],
                                                    rel=0.01)
    assert checks["leases_active_after"] == 0
    assert out["control_iters_hot"] == BUDGET.min_iters * (control_plane.HOT_BLOCK[0] - control_plane.HOT_BLOCK[1])
    assert out["control_iters_cold"] == TINY.cold_iters
    # single blocks: 2 rounds of 8 consecutive calls, 2 untimed; batches and streams: 2 rounds of one call
    single = BUDGET.min_iters * (micro.SINGLE_BLOCK[0] - micro.SINGLE_BLOCK[1])
    for row in report.rows:
        assert row[1] == (single if " x 1 " in row[0] + " " else BUDGET.min_iters), row
    assert len(report.rows) == 2 * 2 * (2 + 2 * 3) + 2 + 2  # sizes x batches x (2 limits + put/get x 3 clients)
    for row in report.control_rows:
        assert row[1] == out["control_iters_hot"], row
    assert len(report.control_rows) == len(control_plane.EFFECTS)
    assert set(out["arena_gbs_by_config"]) == {f"{op} {s}x{b} {c}" for op in ("put", "get")
                                               for s in ("256 KiB", "2 MiB") for b in (1, 4) for c in ("t1", "t2", "grpc")}
    assert out["n_blocks_rss"] == 4096
    # every call of a batch case (2 limits + put/get x 3 clients, warm-up included) read its sources from memory,
    # in both sizes; single blocks kept theirs
    assert checks["cold_source_calls"] == 2 * 8 * (BUDGET.warmup + BUDGET.min_iters)


def test_a_fast_echo_that_never_reaches_the_daemon_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    with DaemonProcess(arena_bytes="64MiB", max_block_bytes="4MiB") as d, \
            Client(d.address, control="fast") as fast, Client(d.address, control="grpc") as grpc, \
            micro._without_key_index(d.address) as no_index:
        monkeypatch.setattr(Client, "echo", lambda self, payload=b"": payload)  # a number without a round trip
        with pytest.raises(RuntimeError, match="a case did not do what it says"):
            micro.control_section(micro.Report(), TINY, fast, grpc, no_index)
