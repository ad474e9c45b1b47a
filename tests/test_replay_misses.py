"""Misses by cause in bench.replay, through a real daemon: the daemon's misses_* counters over a small seeded
AgentX replay, exact per cause, equal to a derivation from the trace and the measured hits (a short probe
whose first missing block no earlier request stored is never_stored, else it left: evicted from RAM alone),
adding up to the replay's short prefix lookups; and the verdict (CLI exit 2) when a count is tampered.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

from bench.replay import replayer
from bench.replay.agentx import AgentXParams, generate
from bench.replay.keys import chain_keys
from bench.replay.miss_check import CAUSES, miss_deltas, miss_figures, miss_mismatch
from bench.replay.replayer import replay
from bench.replay.tiers import StoreSpec
from bench.replay.trace import Request
from bench.replay.verdict import EXIT_MISMATCH, mismatches

SMALL = dict(sessions=6, scale=0.05, seed=1)
ZERO = dict.fromkeys(CAUSES, 0)


def _derived(reqs: Sequence[Request], hits: Sequence[int], gone: str) -> dict[str, int]:
    """Per request whose hit fell short of its chain: its first missing block was stored by an earlier request
    (so it left the store: `gone`) or never; every missed block is put, so 'stored earlier' = 'in an earlier
    chain'."""
    seen: set[bytes] = set()
    out = dict(ZERO)
    for r, n in zip(reqs, hits):
        keys = chain_keys(r.cacheable_ids())
        if n < len(keys):
            out[gone if keys[n] in seen else "never_stored"] += 1
        seen.update(keys)
    return out


def test_ram_replay_counts_one_cause_per_short_probe() -> None:
    reqs = generate(AgentXParams(**SMALL))
    store = replay(reqs, StoreSpec.ram(10_000))
    assert store.verify_failures == 0
    assert store.short_lookups == 185
    assert store.misses_by_cause == {**ZERO, "never_stored": 94, "evicted": 91}
    assert store.misses_by_cause == _derived(reqs, store.hits, "evicted")
    assert miss_figures(store.misses_by_cause, store.short_lookups)["miss_causes_add_up"] is True


def test_ram_disk_replay_misses_were_never_stored() -> None:
    # 23 blocks of RAM, 96 of disk: every block left RAM for the disk, none of the blocks a probe stopped at
    # was reclaimed from disk, so all short probes stopped at a block no request had stored yet
    reqs = generate(AgentXParams(**SMALL))
    store = replay(reqs, StoreSpec.ram_disk(12_000, 49_152))
    assert store.short_lookups == 112
    assert store.misses_by_cause == {**ZERO, "never_stored": 112}
    assert store.misses_by_cause == _derived(reqs, store.hits, "disk_reclaimed")


def test_hinted_replay_adds_up_too() -> None:
    reqs = generate(AgentXParams(**SMALL, hints=True))
    store = replay(reqs, StoreSpec.ram(10_000), hints=True)
    assert store.short_lookups == 175  # the Prefetch hints probe without prefix: not counted, by either side
    assert store.misses_by_cause == {**ZERO, "never_stored": 97, "evicted": 78}
    assert store.misses_by_cause == _derived(reqs, store.hits, "evicted")


def test_deltas_and_the_verdict_on_one_point() -> None:
    before = {"misses_never_stored": 3, "misses_evicted": 1, "hits": 7}
    after = {"misses_never_stored": 5, "misses_evicted": 4, "misses_load_failed": 1, "hits": 9}
    assert miss_deltas(before, after) == {**ZERO, "never_stored": 2, "evicted": 3, "load_failed": 1}
    p = {"capacity_tokens": 10_000, "mismatched_requests": 0, "tier_mismatches": [], "verify_failures": 0,
         **miss_figures({**ZERO, "never_stored": 2, "evicted": 3, "load_failed": 1}, 6)}
    assert p["miss_causes_add_up"] is True and mismatches(p) == []
    p["misses_by_cause"]["evicted"] = 2  # tampered; the stored flag still says True
    assert miss_mismatch(p) == ("misses by cause add up to 5, but 6 prefix lookups stopped short "
                                "(never_stored 2, evicted 2, load_failed 1)")
    assert mismatches(p) == ["RAM 10K: misses by cause add up to 5, but 6 prefix lookups stopped short "
                             "(never_stored 2, evicted 2, load_failed 1)"]


@pytest.mark.parametrize("hints", [False, True])
def test_cli_reports_causes_and_fails_when_a_count_is_tampered(hints: bool, capsys, monkeypatch) -> None:
    from bench.replay.cli import main
    args = ["--agentx", "--sessions", "6", "--scale", "0.05", "--seed", "1"]
    args += ["--hints", "--ram-share", "1", "--hint-shares", "0.2"] if hints else ["--capacity-tokens", "10000"]
    assert main(args) == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    want = {**ZERO, "never_stored": 102, "evicted": 40} if hints else {**ZERO, "never_stored": 94, "evicted": 91}
    assert (d["misses_by_cause"], d["prefix_lookups_short"], d["miss_causes_add_up"]) == (want, sum(want.values()),
                                                                                           True)
    assert d["exact"] and d["mismatches"] == []

    def tampered(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
        out = miss_deltas(before, after)
        out["evicted"] -= 1
        return out

    monkeypatch.setattr(replayer, "miss_deltas", tampered)
    assert main(args) == EXIT_MISMATCH
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert d["miss_causes_add_up"] is False and not d["exact"]
    assert any(f"misses by cause add up to {sum(want.values()) - 1}, but {sum(want.values())} prefix" in m
               for m in d["mismatches"])
