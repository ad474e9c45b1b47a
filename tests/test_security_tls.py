"""Transport security: TLS and mutual TLS on the gRPC TCP listener, owner-only files, refusals at startup."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from kvstore import Client, ConfigError, StoreUnavailableError, UnauthenticatedError
from kvstore.security.tls import TlsFiles
from kvstore.server.config import load_config
from kvstore.testing import DaemonProcess, free_port
from tests.tls_helpers import Pki, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(str(tmp_path_factory.mktemp("pki")))


def _tls_opts(files: TlsFiles, mutual: bool) -> dict[str, str]:
    opts = {"tls_cert": files.cert, "tls_key": files.key}
    if mutual:
        opts["tls_ca"] = files.ca
    return opts


def test_tls_server_only(pki: Pki) -> None:
    with DaemonProcess(**_tls_opts(pki.server, mutual=False)) as d:
        with Client(d.tcp_address, tls=TlsFiles(ca=pki.ca), mode="stream", timeout_s=5) as c:
            c.register_namespace("tls/ns")
            c.put("tls/ns", b"k", b"secret bytes")
            assert c.get("tls/ns", b"k") == b"secret bytes"
        with pytest.raises(StoreUnavailableError):  # plaintext against a TLS port: no handshake, no answer
            Client(d.tcp_address, tls=TlsFiles(), timeout_s=2)
        with Client(d.address, tls=TlsFiles(ca=pki.ca)) as c:  # the unix socket stays plain (owner-only)
            assert c.get("tls/ns", b"k") == b"secret bytes"
        assert f"tcp=127.0.0.1:{d.port}+tls" in d.log()


def test_mutual_tls_requires_a_certificate_the_ca_signed(pki: Pki) -> None:
    with DaemonProcess(**_tls_opts(pki.server, mutual=True)) as d:
        with Client(d.tcp_address, tls=pki.client, mode="stream", timeout_s=5) as c:
            c.register_namespace("mtls/ns")
            assert c.put("mtls/ns", b"k", b"v" * 5000)
        for bad in (TlsFiles(ca=pki.ca), pki.rogue_client):  # no client certificate / one from another CA
            with pytest.raises(StoreUnavailableError):
                Client(d.tcp_address, tls=bad, timeout_s=2)
        assert "+mtls" in d.log()


def test_cli_over_mutual_tls(pki: Pki) -> None:
    with DaemonProcess(**_tls_opts(pki.server, mutual=True)) as d:
        base = [sys.executable, "-m", "kvstore.cli.main", "--address", d.tcp_address]
        tls = ["--tls-ca", pki.ca, "--tls-cert", pki.client.cert, "--tls-key", pki.client.key]
        ok = subprocess.run(base + tls + ["health"], capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0, ok.stderr
        env = {**os.environ, "KVSTORE_TLS_CA": pki.ca, "KVSTORE_TLS_CERT": pki.client.cert,
               "KVSTORE_TLS_KEY": pki.client.key}
        assert subprocess.run(base + ["health"], env=env, capture_output=True, timeout=60).returncode == 0
        bad = subprocess.run(base + ["--tls-ca", pki.ca, "--timeout", "2", "health"], capture_output=True, text=True,
                             timeout=60)
        assert bad.returncode == 2 and "unavailable" in bad.stderr


def test_non_loopback_listener_needs_tls_or_an_explicit_override(pki: Pki, tmp_path) -> None:
    with pytest.raises(ConfigError, match="reachable from other hosts and TLS is off"):
        load_config(["--listen", "0.0.0.0:7070"], env={})
    load_config(["--listen", "0.0.0.0:7070", "--tls-cert", pki.server.cert, "--tls-key", pki.server.key], env={})
    load_config(["--listen", "[::1]:7070"], env={})  # loopback: plaintext stays fine
    with pytest.raises(ConfigError, match="peer_listen='0.0.0.0:7071' is reachable"):
        load_config(["--etcd-endpoints", "http://127.0.0.1:2379", "--peer-listen", "0.0.0.0:7071",
                     "--peer-advertise", "127.0.0.1:7071"], env={})
    with pytest.raises(ConfigError, match="mutual TLS needs tls_ca"):
        load_config(["--etcd-endpoints", "http://127.0.0.1:2379", "--tls-cert", pki.server.cert,
                     "--tls-key", pki.server.key], env={})
    with pytest.raises(ConfigError, match="tls_cert and tls_key go together"):
        load_config(["--tls-cert", pki.server.cert], env={})
    # the override starts the daemon, with a loud warning
    with DaemonProcess(listen=f"0.0.0.0:{free_port()}", allow_insecure_remote=True) as d:
        assert "SECURITY: allow_insecure_remote is set" in d.log()


def test_readable_key_and_world_writable_dirs_are_refused(pki: Pki, tmp_path) -> None:
    loose = tmp_path / "loose-key.pem"
    loose.write_bytes(open(pki.server.key, "rb").read())
    os.chmod(loose, 0o644)
    with pytest.raises(ConfigError, match="readable or writable by other users"):
        load_config(["--tls-cert", pki.server.cert, "--tls-key", str(loose)], env={})
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    d = DaemonProcess(unix_socket=str(shared / "kvstore.sock"))
    try:
        with pytest.raises(RuntimeError, match="world-writable"):
            d.start(timeout_s=20)
        assert d.proc is not None and d.proc.returncode == 2
    finally:
        d.close()


def test_socket_arena_and_files_are_owner_only() -> None:
    with DaemonProcess(disk_bytes="8MiB", disk_segment_bytes="4MiB") as d:
        assert stat.S_IMODE(os.stat(d.socket_path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(d.socket_path + ".arena").st_mode) == 0o600  # the arena's only way in
        assert stat.S_IMODE(os.stat(os.path.dirname(d.socket_path)).st_mode) & 0o077 == 0
        for root, _dirs, files in os.walk(os.path.join(d.workdir, "disk")):
            for f in files:
                assert stat.S_IMODE(os.stat(os.path.join(root, f)).st_mode) & 0o077 == 0, f


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_state_dir_owned_by_another_user_is_refused(tmp_path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 54321, 54321)
    d = DaemonProcess(unix_socket=str(theirs / "kvstore.sock"))
    try:
        with pytest.raises(RuntimeError, match="belongs to uid 54321"):
            d.start(timeout_s=20)
    finally:
        d.close()


def test_tls_and_tokens_together(pki: Pki, tmp_path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alice alice-0123456789abcdef\n")
    os.chmod(tokens, 0o600)
    mine = tmp_path / "alice.token"
    mine.write_text("alice-0123456789abcdef\n")
    os.chmod(mine, 0o600)
    with DaemonProcess(tokens_file=str(tokens), **_tls_opts(pki.server, mutual=True)) as d:
        with Client(d.tcp_address, tls=pki.client, token_file=str(mine), mode="stream", timeout_s=5) as c:
            c.register_namespace("both/ns")
            assert c.put("both/ns", b"k", b"v" * 100)
            assert [n.tenant for n in c.stats().namespaces] == ["alice"]  # the token's tenant owns it
        with pytest.raises(UnauthenticatedError):  # TLS alone is not enough once tokens are on
            Client(d.tcp_address, tls=pki.client, token_file="", timeout_s=5)


def test_tokens_with_a_peer_tier_need_mutual_tls_on_the_peer_plane(pki: Pki, tmp_path) -> None:
    """Peer frames carry no tenant token (peers authenticate as nodes), so with tokens a plaintext peer port
    would let any local process read every tenant's blocks: refused unless TLS or the explicit override."""
    tokens = tmp_path / "tokens"
    tokens.write_text("alice alice-0123456789abcdef\n")
    os.chmod(tokens, 0o600)
    base = ["--etcd-endpoints", "http://127.0.0.1:2379", "--tokens-file", str(tokens)]
    with pytest.raises(ConfigError, match="tokens_file with a peer tier needs mutual TLS on the peer data plane"):
        load_config(base, env={})
    with pytest.raises(ConfigError, match="tokens_file with a peer tier needs mutual TLS"):
        load_config(base + ["--peer-data-plane", "ucx"], env={})
    cfg = load_config(base + ["--tls-cert", pki.server.cert, "--tls-key", pki.server.key, "--tls-ca", pki.server.ca],
                      env={})
    assert cfg.tls.enabled and cfg.peer_data_plane == "tcp"
    assert load_config(base + ["--allow-insecure-remote"], env={}).allow_insecure_remote
    load_config(["--etcd-endpoints", "http://127.0.0.1:2379"], env={})   # no tokens: loopback plaintext is fine
