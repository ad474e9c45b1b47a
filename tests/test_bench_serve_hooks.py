"""bench.serve_hooks' report from its processes' rounds: exact shares, hook medians and the paired wall ratio."""

from __future__ import annotations

import pytest

from bench.serve_hooks import main, summarize


def _round(side: str, wall: float, hooks: dict[str, list[float]] | None = None, daemon: float = 0.0) -> dict:
    hooks = hooks or {}
    return {"side": side, "round": 0, "of": 2, "wall_s": wall, "hooks_s": sum(v[1] for v in hooks.values()),
            "daemon_cpu_s": daemon, "hooks": hooks}


def test_summarize_gives_median_shares_hooks_and_the_ratio_of_each_process_pair() -> None:
    # processes in the order none, kv, kv, none; two rounds each
    none = [_round("none", w) for w in (10.0, 12.0, 11.0, 9.0)]
    kv = [_round("kv", 10.0, {"wait_for_save": [3, 0.2], "get_num_new_matched_tokens": [8, 0.05]}, 0.1),
          _round("kv", 20.0, {"wait_for_save": [3, 0.2], "get_num_new_matched_tokens": [8, 0.05]}, 0.4),
          _round("kv", 12.0, {"wait_for_save": [3, 0.6]}, 0.3),
          _round("kv", 10.0, {"wait_for_save": [3, 0.4], "get_num_new_matched_tokens": [8, 0.15]}, 0.5)]
    out = summarize({"none": none, "kv": kv}, ["none", "kv", "kv", "none"])
    # hooks / wall per round: 0.025, 0.0125, 0.05, 0.055 -> median 0.0375; daemon: 0.01, 0.02, 0.025, 0.05
    assert out["hooks_share"] == 0.0375 and out["daemon_cpu_share"] == 0.0225
    assert out["connector_share"] == 0.06
    assert out["hooks_ms_per_round"] == {"wait_for_save": 300.0, "get_num_new_matched_tokens": 50.0}
    # pairs: processes (none 10,12 -> 11; kv 10,20 -> 15), (none 11,9 -> 10; kv 12,10 -> 11)
    assert out["wall_ratio_pairs"] == [round(15 / 11, 4), 1.1] and out["wall_ratio"] == round((15 / 11 + 1.1) / 2, 4)
    assert out["wall_s_median"] == {"none": 10.5, "kv": 11.0}


@pytest.mark.parametrize("flag", ["--prompts", "--tokens", "--output"])
def test_a_count_below_one_is_refused_before_anything_starts(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([flag, "0"])
    assert exc.value.code == 2 and f"{flag} must be at least 1" in capsys.readouterr().err
