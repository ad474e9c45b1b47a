"""bench.restart's arithmetic: the outage and the first hit from a prober's answers, the JSON's fields and targets.
(The benchmark itself restarts real daemons: `python -m bench.restart`, not CI.)"""

from __future__ import annotations

import json

from bench.restart import TARGETS, Outcome, Prober, report


def test_the_outage_is_the_longest_stretch_without_an_answer_and_the_first_hit_follows_it() -> None:
    p = Prober("unused", b"k", b"v")
    # answers every 2 ms before t0 = 10.0; after it: two more from the old daemon, 0.5 s of silence, a miss, a hit
    p.answers = [(9.990, True), (9.992, True), (9.994, True), (10.001, True), (10.003, True),
                 (10.503, False), (10.505, True), (10.507, True)]
    outage, first_hit, interval = p.result(10.0)
    assert round(outage, 3) == 0.5 and round(first_hit or 0, 3) == 0.502 and round(interval, 3) == 0.002
    p.answers = [(9.99, True), (10.2, False), (10.4, False)]  # cold: answers again, never the block
    assert p.result(10.0)[1] is None


def test_the_json_carries_each_way_and_the_targets(capsys) -> None:
    outs = [Outcome("cold", 2.2, None, 0.0, 0.0, 100, 0.002, 2.5), Outcome("disk-warm", 2.1, 2.1, 0.005, 1.0, 90,
            0.002, 2.3), Outcome("hand-over", 0.04, 0.04, 1.0, 1.0, 700, 0.002, 1.6)]
    lim = {"memcpy_s": 0.05, "odirect_read_s": 0.1, "fd_pass_map_hash_s": 0.05, "memcpy_gbs": 4.0,
           "odirect_read_gbs": 2.0}
    out = report(outs, lim, 200 << 20, None)
    assert (out["handover_unavailable_s"], out["handover_ram_kept"], out["disk_warm_hits_kept"]) == (0.04, 1.0, 1.0)
    assert out["cold_first_hit_s"] is None and out["disk_warm_first_hit_s"] == 2.1
    assert {t.field for t in TARGETS} == set(out["targets"])
    assert all(t["pass"] for t in out["targets"].values())
    json.dumps(out)  # the last line the benchmark prints
    assert "PASS" in capsys.readouterr().out
