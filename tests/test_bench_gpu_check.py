"""bench.gpu_check on a machine without CUDA: a clean skip (exit 0, a clear message, a JSON last line)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would really run")
def test_gpu_check_skips_cleanly_without_cuda() -> None:
    p = subprocess.run([sys.executable, "-m", "bench.gpu_check"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert lines[0].startswith("SKIPPED: GPU check not run: torch.cuda.is_available() is False")
    assert json.loads(lines[-1])["cuda"] is False
