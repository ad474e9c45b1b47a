"""bench.remote's plumbing and arithmetic, without daemons or Mooncake: the limit is the faster raw variant,
every ratio is of medians measured in the same run, the Mooncake row's absence is said and not scored, a case
timed in another process (Timed) is timed by its own figure, and the raw socket moves exact bytes."""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path

import pytest

from bench import remote
from bench._common import Case, Samples, Timed, interleave
from bench.mooncake import rig
from bench.remote_limit import VARIANTS, RawSocket
from bench.targets import evaluate

MB64 = 64 << 20


def _res(**ms: float) -> dict[str, Samples]:
    """Samples whose median is the given milliseconds (three samples around it)."""
    return {name.replace("_", " "): Samples((v / 1e3 * 0.9, v / 1e3, v / 1e3 * 1.5)) for name, v in ms.items()}


def test_figures_take_ratios_of_medians_over_the_faster_raw_variant() -> None:
    res = _res(raw_socket_plain=20.0, raw_socket_tuned=16.0, mooncake_get_tcp=40.0, remote_get_tcp=17.0,
               scheduler_lookup_tcp=1.7, remote_put_tcp=50.0)
    variant = min(VARIANTS, key=lambda v: res[f"raw socket {v}"].p50)
    assert variant == "tuned"
    limit = MB64 / 0.016 / 1e9
    out = remote._figures(res, MB64, limit, variant, "ran")
    assert out["limit_variant"] == "tuned"
    assert out["raw_socket_gbs_by_variant"] == {"plain": round(MB64 / 0.020 / 1e9, 3), "tuned": round(limit, 3)}
    assert out["remote_get_ratio"] == round(16 / 17, 3)
    assert out["remote_get_over_mooncake"] == round(40 / 17, 3)
    assert out["mooncake_ratio"] == round(16 / 40, 3)
    assert out["scheduler_wait_share"] == round(1.7 / 17, 3)
    assert out["ucx_get_gbs"] is None and out["rounds"] == 3
    targets = evaluate(remote.TARGETS, out)
    assert targets["remote_get_ratio"]["pass"] is True and targets["remote_get_over_mooncake"]["pass"] is True


def test_without_mooncake_the_row_says_why_and_its_target_is_not_scored() -> None:
    res = _res(raw_socket_plain=16.0, raw_socket_tuned=18.0, remote_get_tcp=20.0, scheduler_lookup_tcp=1.0,
               remote_put_tcp=50.0)
    out = remote._figures(res, MB64, MB64 / 0.016 / 1e9, "plain", "no Mooncake venv at x: make setup-mooncake")
    assert (out["mooncake_get_gbs"], out["mooncake_ratio"], out["remote_get_over_mooncake"]) == (None, None, None)
    assert out["remote_get_ratio"] == 0.8
    scored = evaluate([t for t in remote.TARGETS if out.get(t.field) is not None], out)
    assert list(scored) == ["remote_get_ratio"] and scored["remote_get_ratio"]["pass"] is False


def test_missing_venv_says_how_to_make_it(tmp_path: Path) -> None:
    why = rig.missing(tmp_path / "nowhere")
    assert why is not None and "make setup-mooncake" in why and str(tmp_path / "nowhere") in why
    (tmp_path / "venv").mkdir()
    assert "no Mooncake venv" in (rig.missing(tmp_path / "venv") or "")   # no stamp: a half-built venv
    (tmp_path / "venv" / ".installed-stamp").touch()
    assert rig.missing(tmp_path / "venv") in (None, "creating a network namespace needs root",
                                              "no `ip` command (apt-get install -y iproute2)")
    if os.geteuid() == 0 and rig.shutil.which("ip"):
        assert rig.missing(tmp_path / "venv") is None


def test_a_mooncake_that_cannot_start_is_a_note_not_a_crash(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed-stamp").touch()                       # stamped, but nothing inside
    with ExitStack() as stack:
        got, note = remote._mooncake(stack, venv)
    assert got is None
    assert note == (rig.missing(venv) or f"could not start: {venv} has no site-packages: rebuild it ({rig.SETUP_HINT})")


def test_a_timed_case_is_timed_by_the_figure_it_returns() -> None:
    calls: list[int] = []

    def elsewhere(_: object) -> Timed:
        calls.append(1)
        return Timed(0.25)
    res = interleave({"remote": Case(elsewhere)}, warmup=1, min_iters=3, budget_s=0)
    assert res["remote"].seconds == (0.25, 0.25, 0.25) and len(calls) == 4
    assert Case(lambda _: 7).once() < 0.25   # any other return value: the wall clock, as before


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_raw_socket_moves_every_byte_of_each_block(variant: str) -> None:
    raw = RawSocket(4 << 20, 1 << 20, variant)
    try:
        raw.dst[:] = 0
        raw.get()
        raw.get()
        assert int(raw.dst.sum()) == 4 << 20     # the sender's buffer is all ones: every byte came, once
    finally:
        raw.close()
    with pytest.raises(ValueError, match="use one of"):
        RawSocket(1 << 20, 1 << 20, "fast")
