"""bench.scheduler_keys runs small: every case's keys are checked against the keys hashed from scratch inside the
run (a case that made other keys would raise), and the JSON line carries each figure."""

from __future__ import annotations

import json

import pytest

from bench import scheduler_keys


def test_a_small_session_measures_scratch_memo_and_limit(capsys: pytest.CaptureFixture[str]) -> None:
    out = scheduler_keys.main(["--turns", "4", "--tokens", "4096", "--output", "20", "--tokens-per-key", "64,16",
                               "--rounds", "2"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == out
    assert set(out["by_tokens_per_key"]) == {"64", "16"}
    assert out["last_prompt_tokens"] == 4 * ((4096 - 4 * 20) // 4) + 3 * 20
    assert out["by_tokens_per_key"]["64"]["keys"] == out["last_prompt_tokens"] // 64
    assert out["by_tokens_per_key"]["16"]["keys"] == out["last_prompt_tokens"] // 16
    for fig in out["by_tokens_per_key"].values():
        assert fig["scratch_ms"] > 0 and fig["memo_ms"] > 0 and fig["limit_ms"] > 0
    assert out["memo_ms"] == out["by_tokens_per_key"]["64"]["memo_ms"]


@pytest.mark.parametrize("argv, says", [(["--tokens-per-key", "24"], "multiples of 16"),
                                        (["--tokens-per-key", "x"], "comma-separated integers"),
                                        (["--turns", "1"], "--turns at least 2")])
def test_bad_arguments_say_what_to_use(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        scheduler_keys.main(argv)
    assert says in capsys.readouterr().err
