"""Bad disk_write / disk_write_budget settings stop the daemon at start with a message that says how to fix them.

Each case goes through the real loader (flags -> ServerConfig.validate), and one through a real daemon process:
exit status 2 and the message on stderr. The budget class refuses the same values when built directly.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvstore.errors import ConfigError
from kvstore.policies.write_budget import WriteBudget
from kvstore.server.config import load_config


@pytest.mark.parametrize(("flags", "message"), [
    (["--disk-write", "flush"], "disk_write='flush': use commit or evict"),
    (["--disk-write", ""], "disk_write='': use commit or evict"),
    (["--disk-write-budget", "0"], "a budget must be > 0 bytes per second"),
    (["--disk-write-budget", "0MiB/s"], "a budget must be > 0 bytes per second"),
    (["--disk-write-budget=-5MiB"], "cannot read '-5MiB' as a size"),
    (["--disk-write-budget", "lots"], "cannot read 'lots' as a size"),
    (["--disk-write-budget", "100TiB"], "past any disk: it is in bytes per second"),
    (["--disk-write-budget", "1KiB", "--max-block-bytes", "16MiB"], "is less than one block of max_block_bytes"),
    (["--disk-write-budget", "200MiB", "--disk-write-budget-window-s", "0"], "disk_write_budget_window_s=0.0"),
    (["--disk-write-budget-window-s", "nan"], "use 1 to 86400 seconds"),
    (["--disk-write-budget-window-s", "1e9"], "use 1 to 86400 seconds"),
    (["--disk-write-budget-window-s", "soon"], "expected a number, got 'soon'"),
    (["--disk-write-budget", "200MiB", "--disk-admission", "never"], "makes no sense; drop one of them"),
    (["--disk-admission", "seen:0"], "N must be 1..255"),
])
def test_bad_disk_write_settings_are_refused_with_a_fix(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(flags, {})
    assert message in str(err.value)


def test_good_settings_load_and_the_budget_reads_units() -> None:
    cfg = load_config(["--disk-write", "commit", "--disk-write-budget", "200MiB/s", "--disk-admission", "seen:2"], {})
    assert (cfg.disk_write, cfg.write_budget, cfg.disk_write_budget_window_s) == ("commit", 200 << 20, 60.0)
    assert load_config([], {}).disk_write == "evict" and load_config([], {}).write_budget is None
    assert load_config([], {"KVSTORE_DISK_WRITE_BUDGET": "1GB"}).write_budget == 10**9


def test_a_toml_integer_budget_is_bytes_per_second(tmp_path) -> None:
    toml = tmp_path / "kv.toml"
    toml.write_text("disk_write_budget = 104857600\ndisk_write = \"evict\"\n")
    assert load_config(["--config", str(toml)], {}).write_budget == 100 << 20


def test_the_daemon_exits_2_and_says_what_to_fix() -> None:
    r = subprocess.run([sys.executable, "-m", "kvstore.server.main", "--disk-write-budget", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "disk_write_budget=0: a budget must be > 0 bytes per second" in r.stderr
    assert "disk_admission = never" in r.stderr  # how to stop writes instead


@pytest.mark.parametrize(("rate", "window", "block"), [(0, 60.0, 1), (-1, 60.0, 1), (True, 60.0, 1),
                                                       (1 << 20, 0.5, 1), (1 << 20, float("inf"), 1),
                                                       (100, 1.0, 4096)])
def test_the_budget_class_refuses_the_same_values(rate: int, window: float, block: int) -> None:
    with pytest.raises(ConfigError, match="invalid config: disk_write_budget"):
        WriteBudget(rate, window, max_block_bytes=block)
