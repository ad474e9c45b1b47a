"""Membership through an etcd that serves TLS, asks for a client certificate and has authentication on.

A real etcd (tests/etcd_secure.py) with a CA of the test's own, `--client-cert-auth`, `--auth-token-ttl 2`,
root and a `kvstore` user whose role may read and write only the member prefix. Real daemons join it: they see
each other and a block crosses between them. A daemon given the wrong CA or the wrong password serves its
local tier, says why once in its log, and joins as soon as the password file is fixed. Tokens that etcd no
longer knows (TTL passed, etcd restarted) are replaced by a new login, counted exactly. The config refuses
half-given or exposed etcd settings before anything starts.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from kvstore.errors import ConfigError
from kvstore.peer.etcd import EtcdClient, EtcdRefused, EtcdUnavailable
from kvstore.peer.placement import rank
from kvstore.security.etcd import EtcdSecurity
from kvstore.server.config.security import unused_peer_settings
from kvstore.server.config import ServerConfig, load_config
from kvstore.testing import DaemonProcess, etcd_binary, free_port, peer_options, wait_until
from tests.etcd_secure import PREFIX, EtcdPki, SecureEtcd, make_etcd_pki
from tests.peer_helpers import needs_etcd
from tests.required import missing
from tests.tenant_helpers import secret
from tests.tls_helpers import make_pki

USER, PASSWORD = "kvstore", "etcd-pass-7f3a9c1e"
TOKEN_TTL_S = 2


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> EtcdPki:
    return make_etcd_pki(str(tmp_path_factory.mktemp("etcd-pki")))


@pytest.fixture(scope="module")
def wrong_ca(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_pki(str(tmp_path_factory.mktemp("other-pki"))).ca  # a CA that did not sign etcd's certificate


@pytest.fixture(scope="module")
def etcd(pki: EtcdPki) -> Iterator[SecureEtcd]:
    if etcd_binary() is None:  # the tests' needs_etcd mark decides first; this guards a direct use
        missing("etcd (the etcd server binary)", "apt-get install -y etcd-server (make setup does)")
    with SecureEtcd(pki, client_cert_auth=True, auth_token_ttl_s=TOKEN_TTL_S) as e:
        e.enable_auth(USER, PASSWORD)
        yield e


@pytest.fixture(scope="module")
def password_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return secret(str(tmp_path_factory.mktemp("etcd-secret") / "etcd-password"), PASSWORD + "\n")


def _security(pki: EtcdPki, password_file: str = "", **over: str) -> EtcdSecurity:
    fields = dict(ca=pki.ca, cert=pki.client.cert, key=pki.client.key, user=USER if password_file else "",
                  password_file=password_file)
    fields.update(over)
    return EtcdSecurity(**fields)


def _node(etcd: SecureEtcd, pki: EtcdPki, password_file: str, **over: object) -> DaemonProcess:
    opts = dict(etcd_ca=pki.ca, etcd_cert=pki.client.cert, etcd_key=pki.client.key, etcd_user=USER,
                etcd_password_file=password_file)
    opts.update(over)
    return DaemonProcess(**peer_options(etcd, ttl_s=2.0, timeout_s=5.0, **opts))  # type: ignore[arg-type]  # the options are kvstore-server flags, typed object


def _lines(log: str, text: str) -> int:
    return sum(text in line for line in log.splitlines())


# -- two daemons over TLS + auth --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(etcd: SecureEtcd, pki: EtcdPki, password_file: str) -> Iterator[dict[str, DaemonProcess]]:
    with ExitStack() as stack:
        nodes = {}
        for name in ("a", "b"):
            d = _node(etcd, pki, password_file, node_id=f"{name}-{os.urandom(3).hex()}")
            stack.callback(d.close)
            nodes[name] = d.start()
        yield nodes


@needs_etcd
def test_two_daemons_join_over_tls_and_auth_and_a_block_crosses(etcd: SecureEtcd, pair) -> None:
    a, b = pair["a"], pair["b"]
    ids = sorted(d.node_id for d in pair.values())
    with a.client() as ca, b.client() as cb:
        for c in (ca, cb):
            wait_until(lambda c=c: len(c.health().peers.members) == 2, 15, 0.05, "both daemons to see 2 members")
            h = c.health().peers
            assert h.etcd_connected and sorted(m.node_id for m in h.members) == ids
        assert etcd.member_ids() == ids  # what etcd holds, read as root
        ns = "etcd-tls/ns"
        for c in (ca, cb):
            c.register_namespace(ns)
        keys = [k for k in (b"k%03d" % i for i in range(64)) if rank(ns, k, ids)[0] == a.node_id][:6]
        values = [bytes([i + 1]) * (40_000 + i) for i in range(len(keys))]
        ca.put_many(ns, keys, values)  # a owns them: nothing to push
        before = cb.stats().peers.counters
        assert cb.get_many(ns, keys) == values  # b misses locally and fetches from a
        after = cb.stats().peers.counters
        assert after["fetched_blocks"] - before["fetched_blocks"] == len(keys)
        assert after["fetch_calls"] - before["fetch_calls"] == 1
    for d in (a, b):
        log = d.log()
        assert _lines(log, f"logged in as '{USER}'") == 1
        assert PASSWORD not in log


@needs_etcd
def test_etcd_restart_forgets_tokens_and_the_daemons_log_in_again(etcd: SecureEtcd, pair) -> None:
    """etcd keeps simple tokens in memory: after a restart every node's token is invalid, and each must log in
    again (once) to keep its record; membership heals without a daemon restart."""
    ids = sorted(d.node_id for d in pair.values())
    relogin = f"etcd answered 'etcdserver: invalid auth token'; logged in again as '{USER}'"
    assert all(_lines(d.log(), relogin) == 0 for d in pair.values())
    etcd.stop()
    with pair["a"].client() as ca:
        wait_until(lambda: not ca.health().peers.etcd_connected, 10, 0.05, "a to notice etcd is gone")
        assert len(ca.health().peers.members) == 2  # the last member set is kept while etcd is down
        etcd.start()
        wait_until(lambda: ca.health().peers.etcd_connected, 15, 0.05, "a to reconnect")
    for d in pair.values():
        wait_until(lambda d=d: _lines(d.log(), relogin) == 1, 15, 0.05, f"{d.node_id} to log in again")
    wait_until(lambda: etcd.member_ids() == ids, 15, 0.05, "both records back in etcd")
    for d in pair.values():
        with d.client() as c:
            wait_until(lambda c=c: c.health().peers.etcd_connected, 15, 0.05, "reconnected")


# -- tokens that expire ----------------------------------------------------------------------------------------

@needs_etcd
def test_an_expired_token_is_replaced_by_one_new_login(etcd: SecureEtcd, pki: EtcdPki, password_file: str) -> None:
    client = EtcdClient([etcd.endpoint], timeout_s=5.0, security=_security(pki, password_file))
    client.put(PREFIX.encode() + b"probe", b"1")
    assert client.logins == 1
    assert client.range_prefix(PREFIX.encode() + b"probe") == [(PREFIX.encode() + b"probe", b"1")]
    assert client.logins == 1  # a live token is reused
    # etcd drops a simple token --auth-token-ttl seconds after its last use, on a 1 s sweep: idle past both.
    # (Waiting is the point here; nothing else can be polled without using, and so renewing, the token.)
    time.sleep(TOKEN_TTL_S + 2)
    assert client.range_prefix(PREFIX.encode() + b"probe") == [(PREFIX.encode() + b"probe", b"1")]
    assert client.logins == 2
    assert client.range_prefix(PREFIX.encode() + b"probe") == [(PREFIX.encode() + b"probe", b"1")]
    assert client.logins == 2


@needs_etcd
def test_auth_turned_on_later_is_followed_by_a_login(pki: EtcdPki, password_file: str, caplog) -> None:
    """etcd over TLS without client certificates and, at first, without auth: the configured user warns once
    (auth off) and works without a token; once etcd's auth is on, the next call logs in and goes through."""
    with SecureEtcd(pki) as tls_only, caplog.at_level(logging.WARNING, logger="kvstore.peer.etcd"):
        client = EtcdClient([tls_only.endpoint], timeout_s=5.0,
                            security=EtcdSecurity(ca=pki.ca, user=USER, password_file=password_file))
        keys = [PREFIX.encode() + b"n%d" % i for i in range(3)]
        for k in keys:
            client.put(k, b"v")
        assert [k for k, _ in client.range_prefix(PREFIX.encode())] == keys
        assert client.logins == 0
        warned = [r.getMessage() for r in caplog.records if "has authentication off" in r.getMessage()]
        assert warned == [f"etcd {tls_only.endpoint} has authentication off: etcd_user '{USER}' is not needed there "
                          "(anyone who reaches etcd can change the member set: turn on etcd's auth)"]
        tls_only.enable_auth(USER, PASSWORD)
        assert [k for k, _ in client.range_prefix(PREFIX.encode())] == keys
        assert client.logins == 1
        with pytest.raises(EtcdRefused, match="requires authentication .*: set etcd_user and etcd_password_file"):
            EtcdClient([tls_only.endpoint], timeout_s=5.0, security=EtcdSecurity(ca=pki.ca)).range_prefix(b"/x/")


@needs_etcd
def test_the_host_name_is_checked_against_etcd_certificate(tmp_path) -> None:
    """etcd's certificate names only "localhost": the right CA is not enough when the URL says 127.0.0.1."""
    pki = make_etcd_pki(str(tmp_path / "pki"), ip_san=False)
    with SecureEtcd(pki, host="localhost") as e:
        sec = EtcdSecurity(ca=pki.ca)
        assert EtcdClient([e.endpoint], timeout_s=5.0, security=sec).range_prefix(b"/x/") == []
        by_ip = e.endpoint.replace("localhost", "127.0.0.1")
        with pytest.raises(EtcdRefused, match=f"etcd {by_ip}: its TLS certificate does not verify against "
                           f"etcd_ca={pki.ca}: IP address mismatch.*use a host name or IP the certificate names"):
            EtcdClient([by_ip], timeout_s=5.0, security=sec).range_prefix(b"/x/")


# -- refusals: clear errors, and the daemon keeps serving ----------------------------------------------------------

def _serves_alone(d: DaemonProcess) -> None:
    with d.client() as c:
        c.register_namespace("local/ns")
        c.put("local/ns", b"k", b"v" * 5000)
        assert c.get("local/ns", b"k") == b"v" * 5000
        h = c.health().peers
        assert not h.etcd_connected and [m.node_id for m in h.members] == [d.node_id]
        wait_until(lambda: c.stats().peers.counters["etcd_errors"] >= 5, 10, 0.05, "five failed ticks")


@needs_etcd
def test_wrong_ca_is_named_once_and_the_daemon_serves_locally(etcd: SecureEtcd, pki: EtcdPki, password_file: str,
                                                               wrong_ca: str) -> None:
    with _node(etcd, pki, password_file, etcd_ca=wrong_ca) as d:
        _serves_alone(d)
        log = d.log()
        assert _lines(log, f"its TLS certificate does not verify against etcd_ca={wrong_ca}") == 1
        assert _lines(log, "set etcd_ca to the CA that signed etcd's certificate") == 1
        assert d.node_id not in etcd.member_ids()


@needs_etcd
def test_wrong_password_is_named_once_and_a_fixed_file_joins(etcd: SecureEtcd, pki: EtcdPki, tmp_path) -> None:
    pw = secret(str(tmp_path / "pw"), "not-the-password\n")
    with _node(etcd, pki, pw) as d:
        _serves_alone(d)
        log = d.log()
        assert _lines(log, f"login as '{USER}' failed (wrong password or unknown user)") == 1
        assert "not-the-password" not in log
        secret(pw, PASSWORD + "\n")  # read again at the next login: no restart needed
        with d.client() as c:
            wait_until(lambda: c.health().peers.etcd_connected, 10, 0.05, "the daemon to join")
        assert d.node_id in etcd.member_ids()
        assert PASSWORD not in d.log()


@needs_etcd
def test_client_refusals_name_what_to_fix(etcd: SecureEtcd, pki: EtcdPki, password_file: str, wrong_ca: str) -> None:
    key = PREFIX.encode()

    def refused(sec: EtcdSecurity, endpoint: str = etcd.endpoint) -> str:
        with pytest.raises(EtcdRefused) as info:
            EtcdClient([endpoint], timeout_s=5.0, security=sec).range_prefix(key)
        return str(info.value)

    assert "does not verify against etcd_ca=" + wrong_ca in refused(_security(pki, password_file, ca=wrong_ca))
    dead = f"https://127.0.0.1:{free_port()}"  # nobody listens: a refusal from the live one says more
    with pytest.raises(EtcdRefused, match=f"^etcd {etcd.endpoint}: its TLS certificate does not verify"):
        EtcdClient([dead, etcd.endpoint], timeout_s=5.0, security=_security(pki, password_file, ca=wrong_ca)
                   ).range_prefix(key)
    assert EtcdClient([dead, etcd.endpoint], timeout_s=5.0, security=_security(pki, password_file)
                      ).range_prefix(b"/kvstore/members/none/") == []  # the live endpoint answers
    # TLS 1.3 sends the refusal of a missing certificate after the handshake: the client reads either etcd's
    # alert (a refusal) or a cut connection (unavailable); both messages say what to set
    with pytest.raises(EtcdUnavailable, match="--client-cert-auth.*set etcd_cert and etcd_key"):
        EtcdClient([etcd.endpoint], timeout_s=5.0, security=_security(pki, password_file, cert="", key="")
                   ).range_prefix(key)
    assert "issue etcd_cert without a CN" in refused(_security(pki, password_file, cert=pki.client_cn.cert,
                                                                key=pki.client_cn.key))
    assert "requires authentication" in refused(_security(pki))  # certificate but no user
    with pytest.raises(EtcdRefused, match=f"user '{USER}' may not call /v3/kv/range .*grant its role readwrite"):
        EtcdClient([etcd.endpoint], timeout_s=5.0, security=_security(pki, password_file)).range_prefix(b"/other/")
    with pytest.raises(EtcdUnavailable, match="closes plain http connections: use https://") as info:
        EtcdClient([etcd.endpoint.replace("https://", "http://")], timeout_s=5.0).range_prefix(key)
    assert not isinstance(info.value, EtcdRefused)



@pytest.mark.parametrize("reset", [False, True], ids=["close", "reset"])
def test_a_tls_endpoint_that_cuts_plain_http_is_named_either_way(reset: bool) -> None:
    """A TLS etcd answers plain http by closing the connection; the client sees an orderly close or a reset,
    depending on timing (CI saw both). Each must carry the hint to use https://, and neither is a refusal."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def cut_once() -> None:
        conn, _ = server.accept()
        conn.recv(65536)  # the whole request, as etcd's TLS listener reads a first record before giving up
        if reset:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
        conn.close()

    thread = threading.Thread(target=cut_once, daemon=True)
    thread.start()
    try:
        with pytest.raises(EtcdUnavailable, match="closes plain http connections: use https://") as info:
            EtcdClient([f"http://127.0.0.1:{port}"], timeout_s=5.0).range_prefix(b"/kvstore/")
        assert not isinstance(info.value, EtcdRefused)
    finally:
        thread.join(timeout=5.0)
        server.close()


# -- config: refused before anything starts -------------------------------------------------------------------------

def _load(*flags: str) -> ServerConfig:
    return load_config(["--unix-socket", "/tmp/kvstore-etcd-test.sock", "--disk-bytes", "0", *flags], {})


def test_config_refuses_half_given_or_exposed_etcd_settings(tmp_path) -> None:
    pki = make_etcd_pki(str(tmp_path / "pki"))
    pw = secret(str(tmp_path / "pw"), PASSWORD)
    tokens = secret(str(tmp_path / "tokens"), "alice alice-0123456789abcdef\n")
    tls = ("--tls-cert", pki.server.cert, "--tls-key", pki.server.key, "--tls-ca", pki.ca)  # peer plane mTLS
    https = ("--etcd-endpoints", "https://10.0.0.5:2379,https://10.0.0.6:2379", "--peer-listen", "127.0.0.1:7071")
    cases = {
        "etcd_cert and etcd_key go together": [*https, "--etcd-cert", pki.client.cert],
        "etcd_user and etcd_password_file go together": [*https, "--etcd-user", USER],
        "mixes http:// and https://": ["--etcd-endpoints", "https://10.0.0.5:2379,http://10.0.0.6:2379"],
        "apply to https:// endpoints": ["--etcd-endpoints", "http://127.0.0.1:2379", "--etcd-ca", pki.ca],
        # one rule, whatever else protects the node: a plain http:// etcd on another host needs the override
        "are plain http to another host: anyone on the path": ["--etcd-endpoints", "http://10.0.0.5:2379"],
        "are plain http to another host: anyone": ["--etcd-endpoints", "http://10.0.0.5:2379", *tls],
        "are plain http to another host: any": [
            "--etcd-endpoints", "http://10.0.0.5:2379", "--etcd-user", USER, "--etcd-password-file", pw],
        "carries credentials": ["--etcd-endpoints", "https://root:pw@10.0.0.5:2379"],
        "cannot read it": [*https, "--etcd-ca", str(tmp_path / "missing.pem")],
    }
    for expected, flags in cases.items():
        with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
            _load(*flags)
    loose = tmp_path / "loose"
    loose.write_text(PASSWORD)
    os.chmod(loose, 0o644)
    with pytest.raises(ConfigError, match=r"etcd_password_file .* is readable or writable by other users \(mode 644\)"
                       r": run `chmod 600"):
        _load(*https, "--etcd-user", USER, "--etcd-password-file", str(loose))
    os.chmod(pki.client.key, 0o640)
    with pytest.raises(ConfigError, match="etcd_key .* is readable or writable by other users"):
        _load(*https, "--etcd-cert", pki.client.cert, "--etcd-key", pki.client.key)
    os.chmod(pki.client.key, 0o600)
    empty = secret(str(tmp_path / "empty"), "\n")
    with pytest.raises(ConfigError, match="is empty: put the etcd password of 'kvstore' on its first line"):
        _load(*https, "--etcd-user", USER, "--etcd-password-file", empty)

    # accepted: https with a CA, a client certificate and a user; https with the system store; a remote
    # plaintext etcd only with allow_insecure_remote; loopback http as before
    cfg = _load(*https, "--etcd-ca", pki.ca, "--etcd-cert", pki.client.cert, "--etcd-key", pki.client.key,
                "--etcd-user", USER, "--etcd-password-file", pw)
    assert cfg.etcd_security == EtcdSecurity(pki.ca, pki.client.cert, pki.client.key, USER, pw)
    assert _load(*https).etcd_security == EtcdSecurity()
    _load("--etcd-endpoints", "http://10.0.0.5:2379", "--tokens-file", tokens, "--allow-insecure-remote")
    _load("--etcd-endpoints", "http://10.0.0.5:2379", "--allow-insecure-remote")
    # without etcd_endpoints the peer tier is off and its settings are not read (a deployment keeps them in its
    # config, pointing into a Secret that may not exist yet); the daemon names them in its start log
    off = _load("--etcd-ca", str(tmp_path / "not-mounted.pem"), "--etcd-user", USER,
                "--etcd-password-file", str(tmp_path / "not-mounted"))
    assert unused_peer_settings(off) == ["etcd_ca", "etcd_user", "etcd_password_file"]
    _load("--etcd-endpoints", "http://127.0.0.1:2379,http://localhost:2380")
    assert PASSWORD not in " ".join(str(v) for v in vars(cfg).values())  # the config holds the path, not the password
