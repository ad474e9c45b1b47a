"""tests/required.py: a missing real component skips its tests for a developer and fails them under CI
(KVSTORE_REQUIRE_ALL=1), whichever way the need is declared (mark, parameter mark, call in the test)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = '''
import pytest
from tests.required import missing, needs

pytestmark = needs(True, "a present component", "nothing to do")

@needs(False, "frobnicator", "apt-get install frobnicator")
def test_marked():
    pass

@pytest.mark.parametrize("x", [1, pytest.param(2, marks=needs(False, "widget", "pip install widget"))])
def test_param(x):
    pass

def test_inline():
    missing("gizmo", "make gizmo")
'''


def _outcomes(tmp_path: Path, require_all: str | None) -> tuple[dict[str, int], str]:
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_REQUIRE_ALL"}
    if require_all is not None:
        env["KVSTORE_REQUIRE_ALL"] = require_all
    # -p tests.conftest: the repository's hook that turns an unmet `needs` mark into a skip or a failure
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "tests.conftest",
                        "--rootdir", str(tmp_path), str(tmp_path / "test_probe.py")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    last = p.stdout.strip().splitlines()[-1]
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|skipped|failed|errors?)", last)}, p.stdout


@pytest.mark.parametrize("value", [None, "0"])
def test_a_developer_gets_skips_that_say_how_to_install(tmp_path: Path, value: str | None) -> None:
    counts, out = _outcomes(tmp_path, value)
    assert counts == {"passed": 1, "skipped": 3}, out
    for msg in ("frobnicator missing: apt-get install frobnicator", "widget missing: pip install widget",
                "gizmo missing: make gizmo"):
        assert msg in out


def test_ci_gets_failures(tmp_path: Path) -> None:
    counts, out = _outcomes(tmp_path, "1")
    assert counts == {"passed": 1, "failed": 1, "errors": 2}, out   # marks fail at setup (errors), the call in the test
    assert out.count("KVSTORE_REQUIRE_ALL=1: CI needs every component") >= 3
