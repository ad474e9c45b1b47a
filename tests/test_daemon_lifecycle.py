"""The daemon process: start-up checks, graceful and ungraceful stops, restarts, configuration."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys

import pytest

from kvstore import Client
from kvstore.server.config import load_config, parse_size
from kvstore.errors import ConfigError
from kvstore.testing import DaemonProcess

NS = "life/ns"


def _arena_files_of(pid: int) -> list[str]:
    """What the daemon's descriptors point at that is arena memory: memfds, or anything under /dev/shm."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:kvstore") or target.startswith("/dev/shm"):
            out.append(target)
    return sorted(out)


def test_sigterm_removes_sockets_and_the_arena_has_no_name(make_daemon) -> None:
    d = make_daemon()
    arena_socket = d.socket_path + ".arena"
    for path in (d.socket_path, arena_socket):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    # the arena is an anonymous memory file: nothing in /dev/shm that another process could open by name
    assert not [n for n in os.listdir("/dev/shm") if d.node_id in n]
    # and the RAM journal (a hand-over's record of each slot) is another one, which no client is handed
    # (held by one descriptor or more each)
    assert sorted(set(_arena_files_of(d.proc.pid))) == [f"/memfd:kvstore-journal-kvstore-{d.node_id} (deleted)",
                                                        f"/memfd:kvstore-{d.node_id} (deleted)"]
    assert d.stop(signal.SIGTERM) == 0
    assert not os.path.exists(d.socket_path)
    assert not os.path.exists(arena_socket)
    assert "msg=stopped" in d.log()


def test_second_daemon_on_the_same_socket_is_refused(make_daemon) -> None:
    first = make_daemon()
    second = DaemonProcess(unix_socket=first.socket_path, arena_name=first.arena_name)
    try:
        with pytest.raises(RuntimeError, match="is in use by a running process"):
            second.start()
        assert second.proc is not None and second.proc.returncode == 2
    finally:
        second.close()
    with first.client() as c:
        assert c.health().status == "SERVING"
        c.register_namespace(NS)
        assert c.put(NS, b"k", b"v" * 100) is True and c.get(NS, b"k") == b"v" * 100


def test_killed_daemon_leaves_no_arena_behind_and_clients_remap(make_daemon, tmp_path) -> None:
    d = make_daemon(workdir=str(tmp_path))
    client = d.client()
    client.register_namespace(NS)
    client.put(NS, b"before", b"x" * 1000)
    d.stop(signal.SIGKILL)
    assert not [n for n in os.listdir("/dev/shm") if d.node_id in n]  # nothing to clean up after a kill -9
    assert os.path.exists(d.socket_path + ".arena")  # a stale socket file: the next start replaces it
    d.start()  # same sockets
    assert d.proc is not None and d.proc.poll() is None
    # the old client notices the new incarnation and maps the new arena; the RAM tier started empty
    client.register_namespace(NS)
    assert client.get(NS, b"before") is None
    assert client.put(NS, b"after", b"y" * 5000) is True
    assert client.get(NS, b"after") == b"y" * 5000
    client.close()


def test_arena_lock_is_reported_truthfully(make_daemon) -> None:
    d = make_daemon(arena_lock="auto")
    with d.client() as c:
        locked = c.stats().arena_locked
    can_lock = os.geteuid() == 0 or _memlock_limit() >= (64 << 20) + (2 << 20)
    assert locked is can_lock
    if not locked:
        assert "running with an unlocked arena" in d.log()


def _memlock_limit() -> int:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return soft if soft != resource.RLIM_INFINITY else 1 << 62


@pytest.mark.parametrize(
    "args,message",
    [
        (["--arena-bytes", "lots"], "cannot read 'lots' as a size"),
        (["--policy", "fifo"], "policy='fifo': use one of lru, s3fifo"),
        (["--high-watermark", "0.5", "--low-watermark", "0.9"], "need 0 < low <= high <= 1"),
        (["--listen", "nowhere"], "listen='nowhere': expected host:port"),
        (["--arena-bytes", "4MiB", "--max-block-bytes", "4MiB"], "must be at least 2 x max_block_bytes"),
        (["--lease-ttl-s", "soon"], "lease_ttl_s (from --lease-ttl-s): expected a number"),
    ],
)
def test_bad_flags_exit_2_with_a_message(args: list[str], message: str) -> None:
    r = subprocess.run([sys.executable, "-m", "kvstore.server.main", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert message in r.stderr


def test_config_precedence_file_env_flag(tmp_path) -> None:
    toml = tmp_path / "kv.toml"
    toml.write_text('arena_bytes = "256MiB"\npolicy = "s3fifo"\nlease_ttl_s = 5\n')
    cfg = load_config(["--config", str(toml), "--lease-ttl-s", "7"], {"KVSTORE_POLICY": "lru", "KVSTORE_NODE_ID": "n1"})
    assert (cfg.arena_bytes, cfg.policy, cfg.lease_ttl_s, cfg.node_id) == (256 << 20, "lru", 7.0, "n1")
    assert cfg.shm_name == "/kvstore-n1"
    toml.write_text("arena_byte = 1\n")
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) \['arena_byte'\]"):
        load_config(["--config", str(toml)], {})
    toml.write_text("arena_bytes = [1]\n")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(["--config", str(toml)], {})
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(["--config", str(tmp_path / "missing.toml")], {})
    assert parse_size("1.5GiB") == 3 << 29 and parse_size("4096") == 4096 and parse_size(" 2 mib ") == 2 << 20


def test_daemon_help_lists_every_setting() -> None:
    r = subprocess.run([sys.executable, "-m", "kvstore.server.main", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for flag in ("--arena-bytes", "--policy", "--lease-ttl-s", "--unix-socket", "--listen", "--config"):
        assert flag in r.stdout


def test_client_against_no_daemon_says_how_to_fix(tmp_path) -> None:
    from kvstore import StoreUnavailableError

    with pytest.raises(StoreUnavailableError, match="is kvstore-server running"):
        Client("unix:" + str(tmp_path / "none.sock"), timeout_s=1)


def test_live_socket_of_another_daemon_is_not_stolen(make_daemon) -> None:
    first = make_daemon()
    second = DaemonProcess(unix_socket=first.socket_path)
    with pytest.raises(RuntimeError, match="is in use by a running process"):
        second.start()
    second.close()
    with first.client() as c:
        assert c.health().status == "SERVING"
