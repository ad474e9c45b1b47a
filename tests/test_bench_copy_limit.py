"""bench/copy_limit.py's cache helpers: the last-level cache's size read from sysfs; ColdSources, which evicts a
copy's sources (or, where the CPU cannot, reads a buffer as large as the cache through); and `cold`, which runs it
after a case's own setup, both untimed."""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest

from bench._common import Case
from bench import copy_limit
from bench.copy_limit import ColdSources, cold, last_level_cache_bytes


def _cache_dir(root: Path, index: int, size: str) -> None:
    d = root / f"index{index}"
    d.mkdir()
    (d / "size").write_text(size + "\n")


def test_the_largest_cache_is_the_last_level(tmp_path: Path) -> None:
    for i, size in enumerate(["48K", "32K", "2048K", "307200K"]):
        _cache_dir(tmp_path, i, size)
    assert last_level_cache_bytes(root=str(tmp_path)) == 307200 * 1024
    (tmp_path / "index4").mkdir()  # a cache directory without a size file is skipped
    assert last_level_cache_bytes(root=str(tmp_path)) == 307200 * 1024


def test_units_and_unreadable_sizes(tmp_path: Path) -> None:
    _cache_dir(tmp_path, 0, "2M")
    _cache_dir(tmp_path, 1, "1G")
    _cache_dir(tmp_path, 2, "lots")
    assert last_level_cache_bytes(root=str(tmp_path)) == 1 << 30
    assert last_level_cache_bytes(default=7, root=str(tmp_path / "absent")) == 7


def test_cold_runs_after_the_setup_with_its_value_and_times_only_the_case() -> None:
    order: list[str] = []
    case = Case(lambda arg: order.append(f"fn {arg}"), setup=lambda: order.append("setup") or 5,
                teardown=lambda arg: order.append(f"teardown {arg}"))
    wrapped = cold(case, lambda arg: order.append(f"evict {arg}"))
    wrapped.once()
    wrapped.once()
    assert order == ["setup", "evict 5", "fn 5", "teardown 5"] * 2
    bare = cold(Case(lambda arg: order.append(f"bare {arg}")), lambda arg: order.append(f"evict {arg}"))
    bare.once()
    assert order[-2:] == ["evict None", "bare None"]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="clflush is x86-64's; elsewhere the fallback runs")
def test_sources_are_evicted_in_place_on_x86() -> None:
    buf = np.arange(1 << 20, dtype=np.uint8)
    cs = ColdSources(fallback_bytes=1 << 20)
    cs(np.asarray([buf.ctypes.data], np.uint64), np.asarray([buf.nbytes], np.uint64))
    assert cs.calls == 1 and cs._fallback is None  # no fallback buffer was ever made
    assert np.array_equal(buf, np.arange(1 << 20, dtype=np.uint8))  # evicted, not changed


def test_where_nothing_is_evicted_a_buffer_is_read_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copy_limit, "evict_lines", lambda addrs, lengths: 0)  # what other CPUs answer
    buf = np.ones(4096, np.uint8)
    cs = ColdSources(fallback_bytes=1 << 20)
    cs(np.asarray([buf.ctypes.data], np.uint64), np.asarray([buf.nbytes], np.uint64))
    assert cs._fallback is not None
    src, dst = cs._fallback
    assert src.nbytes == dst.nbytes == 1 << 20 and np.array_equal(dst, src)  # the whole buffer went through
    cs(np.asarray([], np.uint64), np.asarray([], np.uint64))  # nothing to read: nothing to push out
    assert cs.calls == 2
