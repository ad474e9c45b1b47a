"""The config is composed and each rule lives in one place: the daemon's message for a component's setting is the
component config's own, the disk codec list is the codec registry's, factories raise ConfigError, and the module
maps of the packages this work touches list exactly their files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvstore.engine.config import EngineConfig
from kvstore.errors import ConfigError
from kvstore.peer.cluster import PeerConfig
from kvstore.policies import make_policy
from kvstore.policies.admission import make_admission
from kvstore.server.config import ServerConfig, load_config
from kvstore.tiers.disk.codec import CODEC_IDS
from kvstore.tiers.disk.config import CODECS, DISK_CODECS, DiskConfig

ROOT = Path(__file__).resolve().parent.parent
BASE = ["--unix-socket", "/tmp/kvstore-config-test.sock", "--disk-dir", "/tmp/kvstore-config-test-disk"]
MiB = 1 << 20


def _message(exc_info: pytest.ExceptionInfo[ConfigError]) -> str:
    return str(exc_info.value)


@pytest.mark.parametrize(("flags", "direct"), [
    (["--disk-segment-bytes", str(3 * MiB // 2)], {"segment_bytes": 3 * MiB // 2}),
    (["--disk-bytes", "3MiB", "--disk-segment-bytes", "2MiB", "--max-block-bytes", "1MiB", "--arena-bytes", "4MiB"],
     {"capacity_bytes": 3 * MiB, "segment_bytes": 2 * MiB}),
    (["--disk-sync", "always"], {"sync": "always"}),
    (["--disk-codec", "lz4"], {"compression": "lz4"}),
    (["--disk-probe-interval-s", "0"], {"probe_interval_s": 0.0}),
    (["--disk-reinsert-hits", "256"], {"reinsert_hits": 256}),
])
def test_the_daemon_reports_the_disk_tiers_own_rule(flags: list[str], direct: dict) -> None:
    with pytest.raises(ConfigError) as from_daemon:
        load_config([*BASE, *flags], env={})
    opts = {"directory": "/tmp/d", "capacity_bytes": 8 << 30, "segment_bytes": 256 * MiB, **direct}
    with pytest.raises(ConfigError) as from_disk:
        DiskConfig(**opts)
    assert _message(from_daemon) == _message(from_disk)
    assert _message(from_daemon).startswith("invalid config: disk_")


def test_disk_settings_are_checked_with_the_disk_tier_off() -> None:
    with pytest.raises(ConfigError, match=r"disk_sync='always': use one of data, none \('data' is crash-safe\)"):
        load_config([*BASE, "--disk-bytes", "0", "--disk-sync", "always"], env={})
    with pytest.raises(ConfigError, match="disk_codec='lz4': use one of none, zstd, zstd-shuffle2"):
        load_config([*BASE, "--disk-bytes", "0", "--disk-codec", "lz4"], env={})
    cfg = load_config([*BASE, "--disk-bytes", "0", "--disk-dir", ""], env={})  # no tier: no directory needed
    assert cfg.disk_config() is None


@pytest.mark.parametrize(("flags", "direct"), [
    (["--max-block-bytes", "5000", "--arena-bytes", "1MiB"], {"max_block_bytes": 5000}),
    (["--high-watermark", "0.5", "--low-watermark", "0.9"], {"high_watermark": 0.5, "low_watermark": 0.9}),
    (["--lease-ttl-s", "0"], {"lease_ttl_s": 0.0}),
    (["--max-batch-keys", "0"], {"max_batch_keys": 0}),
    (["--promote-timeout-s", "0"], {"promote_timeout_s": 0.0}),
    (["--write-queue-blocks", "0"], {"write_queue_blocks": 0}),
])
def test_the_daemon_reports_the_engines_own_rule(flags: list[str], direct: dict) -> None:
    with pytest.raises(ConfigError) as from_daemon:
        load_config([*BASE, *flags], env={})
    with pytest.raises(ConfigError) as from_engine:
        EngineConfig(**{"max_block_bytes": 16 * MiB, **direct})
    assert _message(from_daemon) == _message(from_engine)


@pytest.mark.parametrize(("flags", "field", "value"), [
    (["--peer-data-plane", "rdma"], "data_plane", "rdma"),
    (["--peer-replication", "all"], "replication", "all"),
    (["--peer-timeout-s", "0"], "timeout_s", 0.0),
    (["--peer-idle-timeout-s", "0.5"], "idle_timeout_s", 0.5),
    (["--etcd-prefix", "members"], "etcd_prefix", "members"),
    (["--peer-listen", "nohost"], "listen", "nohost"),
])
def test_the_daemon_reports_the_peer_tiers_own_rule(flags: list[str], field: str, value: object) -> None:
    with pytest.raises(ConfigError) as from_daemon:
        load_config([*BASE, *flags], env={})
    good = load_config(BASE, env={}).peer_config()
    with pytest.raises(ConfigError) as from_peer:
        PeerConfig(**{**good.__dict__, field: value})
    assert _message(from_daemon) == _message(from_peer)


def test_server_config_builds_the_component_configs() -> None:
    cfg = load_config([*BASE, "--disk-bytes", "64MiB", "--disk-segment-bytes", "16MiB", "--disk-codec", "zstd",
                       "--quarantine-s", "-1", "--reservation-ttl-s", "12", "--peer-timeout-s", "0.5"], env={})
    eng, disk, peer = cfg.engine_config(), cfg.disk_config(), cfg.peer_config(capacity_bytes=123)
    assert (eng.quarantine_s, eng.disk_codec, eng.max_block_bytes, eng.isolate_tenants) == (12.0, "zstd", 16 * MiB,
                                                                                            False)
    assert disk == DiskConfig("/tmp/kvstore-config-test-disk", 64 * MiB, 16 * MiB, "data", "zstd", 5.0, 1)
    assert (peer.timeout_s, peer.capacity_bytes, peer.control_address, peer.etcd_endpoints) == (
        0.5, 123, "127.0.0.1:7070", ())


def test_codec_names_come_from_the_registry() -> None:
    assert CODECS == tuple(CODEC_IDS) and DISK_CODECS == ("", *CODECS)
    sources = "".join(p.read_text() for p in (ROOT / "kvstore" / "server" / "config").glob("*.py"))
    assert not re.search(r"[\"']zstd", sources)  # no codec name as a literal: the list and help are the registry's


def test_factories_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="policy='fifo': use one of lru, s3fifo"):
        make_policy("fifo")
    with pytest.raises(ConfigError, match="disk_admission='sometimes'"):
        make_admission("sometimes")
    with pytest.raises(ConfigError, match="disk_admission seen:0"):
        make_admission("seen:0")


# Message fragments of rules that used to be written twice (or would be, if a component and the daemon both
# checked): each must occur exactly once in the sources of kvstore/.
ONCE = ["must be a positive multiple of 1 MiB", "holds fewer than 2 segments", "'data' is crash-safe", "must be a positive number of "
        "seconds", "(plain FIFO) ..", "need 0 < low <= high <= 1", "use a multiple of 4096 (e.g. 16MiB)",
        "use 0.5..300 seconds", "is not an etcd client URL", "use one of {', '.join(POLICY_NAMES)}",
        "max_batch_keys={self.max_batch_keys}: use 1..65536", "write_queue_blocks={self",
        "promote_timeout_s={self", "peer_data_plane={self", "disk_codec={compression"]


@pytest.mark.parametrize("fragment", ONCE)
def test_each_rule_is_written_once(fragment: str) -> None:
    hits = [str(p.relative_to(ROOT)) for p in (ROOT / "kvstore").rglob("*.py") if fragment in p.read_text()
            for _ in range(p.read_text().count(fragment))]
    assert len(hits) == 1, f"{fragment!r} in {hits}"


def _module_map(package: Path) -> set[str]:
    doc = (package / "__init__.py").read_text().split('"""')[1]
    return set(re.findall(r"^ {4}(\w+\.py) ", doc, flags=re.M))


@pytest.mark.parametrize("package", ["kvstore/tiers/disk", "kvstore/server/config"])
def test_module_map_lists_exactly_the_files(package: str) -> None:
    path = ROOT / package
    files = {p.name for p in path.glob("*.py") if p.name != "__init__.py"}
    assert _module_map(path) == files


def test_no_config_file_over_400_lines() -> None:
    paths = [*(ROOT / "kvstore" / "server" / "config").glob("*.py"), *(ROOT / "kvstore" / "tiers").rglob("*.py"),
             ROOT / "kvstore" / "server" / "main.py", ROOT / "kvstore" / "engine" / "config.py",
             ROOT / "kvstore" / "server" / "config_doc.py"]
    long = {str(p.relative_to(ROOT)): n for p in paths if (n := len(p.read_text().splitlines())) > 400}
    assert not long and isinstance(ServerConfig, type)
