"""The daemon's collector settings (kvstore/server/heap.py): what settle() does to this process's gc, that a
real daemon applies its gc_young_threshold setting once serving, and that bad values are refused.

settle() changes process-wide state (a frozen heap cannot be thawed into the same generations), so its unit
checks run in a child interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvstore.errors import ConfigError
from kvstore.server.config.loader import load_config
from kvstore.server.heap import GEN0_THRESHOLD

CONFIG_BASE = ["--unix-socket", "/tmp/kvstore-heap-test.sock", "--disk-bytes", "0"]

_CHILD = """
import gc, json, sys
from kvstore.server.heap import settle
before = gc.get_threshold()
frozen = settle(int(sys.argv[1]))
print(json.dumps({"before": before, "after": gc.get_threshold(), "frozen": frozen,
                  "freeze_count": gc.get_freeze_count(), "enabled": gc.isenabled()}))
"""


def _settle_in_child(threshold: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(threshold)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_settle_freezes_the_startup_heap_and_sets_the_young_threshold() -> None:
    got = _settle_in_child(10_000)
    assert got["before"][0] == 700                      # CPython's default, as the child started
    assert got["after"] == [10_000, got["before"][1], got["before"][2]]
    assert got["frozen"] == got["freeze_count"] > 1000  # every module and class of the daemon's imports
    assert got["enabled"] is True                       # collection is not turned off, only less often


def test_settle_with_zero_keeps_cpythons_defaults() -> None:
    got = _settle_in_child(0)
    assert got["after"] == got["before"]
    assert got["frozen"] == got["freeze_count"] == 0


def test_a_daemon_settles_its_heap_once_serving(make_daemon) -> None:
    d = make_daemon()
    assert f"young-generation threshold {GEN0_THRESHOLD}" in d.log()
    assert "startup objects frozen" in d.log()
    off = make_daemon(gc_young_threshold=0)
    assert "CPython's collector defaults kept (gc_young_threshold 0)" in off.log()
    assert "startup objects frozen" not in off.log()


def test_the_gc_young_threshold_setting_is_checked() -> None:
    assert load_config(CONFIG_BASE, env={}).gc_young_threshold == GEN0_THRESHOLD
    assert load_config([*CONFIG_BASE, "--gc-young-threshold", "0"], env={}).gc_young_threshold == 0
    assert load_config(CONFIG_BASE, env={"KVSTORE_GC_YOUNG_THRESHOLD": "700"}).gc_young_threshold == 700
    for bad in (-1, 5, 699, 1_000_001):
        with pytest.raises(ConfigError, match=rf"gc_young_threshold={bad}: use 0 \(CPython's defaults\) or "
                                              r"700\.\.1000000"):
            load_config([*CONFIG_BASE, "--gc-young-threshold", str(bad)], env={})
