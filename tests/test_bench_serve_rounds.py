"""bench.serve's rounds (bench/serve/rounds.py): the order each round runs in, which servers make room for a
boot, and how the rounds' summaries and ratios become one report."""

from __future__ import annotations

import pytest

from bench.serve.rounds import SEED_STEP, median_summary, paired_ratios, make_room, round_seed, schedule
from bench.serve.run import _parser, crossover_ratio, main


def test_schedule_reverses_the_order_every_other_round() -> None:
    assert schedule(["a", "b", "f"], 1) == [(0, "a"), (0, "b"), (0, "f")]
    assert schedule(["a", "b", "f"], 3) == [(0, "a"), (0, "b"), (0, "f"), (1, "f"), (1, "b"), (1, "a"),
                                            (2, "a"), (2, "b"), (2, "f")]


def test_round_seeds_are_apart_from_each_other_and_from_the_no_reuse_prompts() -> None:
    assert [round_seed(5, r) for r in range(3)] == [5, 5 + SEED_STEP, 5 + 2 * SEED_STEP]


def test_room_is_made_by_stopping_the_server_needed_again_latest() -> None:
    seq = ["a", "b", "f", "e", "a"]
    # e needs E; A, B, F run; at most 3: B and F are never needed again, A is (the last a): B goes
    assert make_room(seq, 3, {"A", "B", "F"}, ["E"], 3) == ["B"]
    # room for two: F goes too (not needed again either: a tie, broken by name)
    assert make_room(seq, 3, {"A", "B", "F"}, ["E"], 2) == ["B", "F"]
    # nothing to stop while the boot fits
    assert make_room(seq, 3, {"A", "B"}, ["E"], 4) == []
    # a server the configuration itself uses never goes, even over the limit
    assert make_room(["d", "a"], 0, {"B", "B2", "A"}, ["B", "B2"], 1) == ["A"]


def test_median_summary_takes_each_figure_over_the_rounds() -> None:
    rounds = [{"label": "x", "calls": 62, "ttft_p50_s": 0.1, "output_tok_s": 30.0, "queue_s_mean": None,
               "store_served_tokens": {"ram": 100}},
              {"label": "x", "calls": 62, "ttft_p50_s": 0.3, "output_tok_s": 50.0, "queue_s_mean": 0.2,
               "store_served_tokens": {"ram": 300, "disk": 4}},
              {"label": "x", "calls": 62, "ttft_p50_s": 0.2, "output_tok_s": 10.0, "queue_s_mean": 0.1,
               "store_served_tokens": {"ram": 200}}]
    s = median_summary(rounds)
    assert s == {"label": "x", "calls": 62, "ttft_p50_s": 0.2, "output_tok_s": 30.0,
                 "queue_s_mean": None,  # not a number in every round: the first round's
                 "store_served_tokens": {"disk": 0, "ram": 200}}
    assert median_summary(rounds[:1]) is rounds[0]


def test_ratios_are_paired_within_rounds_then_crossed_over() -> None:
    lines = [{"ttft_p50_speedup": 8.0, "ttft_p50_vs_limit": 1.2, "ttft_p50_speedup_disk": None},
             {"ttft_p50_speedup": 12.0, "ttft_p50_vs_limit": 0.8, "ttft_p50_speedup_disk": None},
             {"ttft_p50_speedup": 9.0, "ttft_p50_vs_limit": 1.0, "ttft_p50_speedup_disk": None}]
    got = paired_ratios(lines)
    assert got == {"ttft_p50_speedup": [8.0, 12.0, 9.0], "ttft_p50_vs_limit": [1.2, 0.8, 1.0]}
    # the first pair's geometric mean and the odd last round, then their median
    assert crossover_ratio(got["ttft_p50_speedup"]) == round(((8.0 * 12.0) ** 0.5 + 9.0) / 2, 4)


@pytest.mark.parametrize("argv, message", [(["--rounds", "0"], "--rounds: use 1 to 20"),
                                           (["--rounds", "21"], "--rounds: use 1 to 20"),
                                           (["--no-reuse-rounds", str(SEED_STEP)], "--no-reuse-rounds: use at most")])
def test_bad_rounds_are_refused_with_the_range(argv: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--configs", "a", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert _parser().parse_args([]).rounds == 1
