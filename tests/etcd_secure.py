"""A real etcd that serves its client port over TLS (optionally mutual TLS) with authentication on.

`make_etcd_pki` writes one CA, a server certificate for 127.0.0.1/localhost, and client certificates: one
without a CommonName (what etcd's JSON gateway accepts once auth is on: it refuses a client certificate that
carries a CN, because the gateway cannot map a CN to a user, with "CommonName of client sending a request
against gateway will be ignored") and one with a CN (to show that refusal). The files are written with the
helpers of tests/tls_helpers.py; the wrong CA of the tests is that module's `make_pki` CA.

`SecureEtcd` is an EtcdProcess (kvstore/testing/etcd.py) started with TLS flags; `enable_auth` creates root
and a `kvstore` user whose role may read and write only the member prefix, then turns auth on (etcd's
/v3/auth/* gateway calls: Debian's etcd-server ships no etcdctl). `stop()`/`start()` keep ports and data: a
restart forgets every simple token. Why certificates are made here and not by tls_helpers.make_pki: its
certificates all carry a CN and it keeps no CA key to sign more.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import os
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvstore.security.tls import TlsFiles
from kvstore.testing import EtcdProcess
from tests.tls_helpers import _key_pem, _write

__all__ = ["EtcdPki", "SecureEtcd", "make_etcd_pki", "PREFIX"]

PREFIX = "/kvstore/members/"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _range(prefix: str) -> dict[str, str]:
    """key + range_end that select every key under `prefix` (etcd's convention: last byte + 1)."""
    end = bytearray(prefix.encode())
    end[-1] += 1
    return {"key": _b64(prefix.encode()), "range_end": _b64(bytes(end))}


def _cert(subject: x509.Name, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, issuer_key, *, ca: bool,
          server: bool = False, ip_san: bool = True) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
         .serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        names: list[x509.GeneralName] = [x509.DNSName("localhost")]
        if ip_san:
            names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
        b = b.add_extension(x509.SubjectAlternativeName(names), critical=False)
    if not ca:  # the server certificate is also the client certificate etcd's gateway dials etcd with
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                            critical=False)
    return b.sign(issuer_key, hashes.SHA256())


@dataclass(frozen=True)
class EtcdPki:
    ca: str
    server: TlsFiles      # etcd's certificate (127.0.0.1, localhost)
    client: TlsFiles      # a client certificate without a CommonName (ca = the right CA)
    client_cn: TlsFiles   # a client certificate with CN "kvstore-node" (refused by the gateway once auth is on)


def make_etcd_pki(directory: str, ip_san: bool = True) -> EtcdPki:
    """ip_san=False: etcd's certificate names only "localhost", so https://127.0.0.1 fails the host check."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "etcd-test-ca")])
    ca_cert = _cert(ca_name, ca_key, ca_name, ca_key, ca=True)
    ca = _write(os.path.join(directory, "etcd-ca.pem"), ca_cert.public_bytes(serialization.Encoding.PEM))
    subjects = {
        "server": x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "etcd-server")]),
        "client": x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvstore nodes")]),
        "client_cn": x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvstore-node")]),
    }
    out: dict[str, TlsFiles] = {}
    for name, subject in subjects.items():
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(subject, key, ca_name, ca_key, ca=False, server=name == "server", ip_san=ip_san)
        out[name] = TlsFiles(_write(os.path.join(directory, f"etcd-{name}.pem"),
                                    cert.public_bytes(serialization.Encoding.PEM)),
                             _write(os.path.join(directory, f"etcd-{name}-key.pem"), _key_pem(key), 0o600), ca)
    return EtcdPki(ca, out["server"], out["client"], out["client_cn"])


class SecureEtcd(EtcdProcess):
    """etcd on https://<host>:<port> (listening on 127.0.0.1); `client_cert_auth` makes it require a client
    certificate. Ports, data directory, start, log and stop/close are EtcdProcess's; the hooks add TLS."""

    def __init__(self, pki: EtcdPki, *, client_cert_auth: bool = False, auth_token_ttl_s: int | None = None,
                 host: str = "127.0.0.1") -> None:
        super().__init__()
        self.pki = pki
        self.client_cert_auth = client_cert_auth
        self.auth_token_ttl_s = auth_token_ttl_s
        self.host = host  # the name clients use (etcd listens on 127.0.0.1 either way)
        self._root_password = ""

    @property
    def endpoint(self) -> str:
        return f"https://{self.host}:{self.client_port}"

    def _context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.pki.ca)
        if self.client_cert_auth:
            ctx.load_cert_chain(self.pki.client.cert, self.pki.client.key)
        return ctx

    def _name(self) -> str:
        return "kvstore-tls"

    def _listen_client_url(self) -> str:
        return f"https://127.0.0.1:{self.client_port}"

    def _extra_args(self) -> list[str]:
        args = ["--cert-file", self.pki.server.cert, "--key-file", self.pki.server.key]
        if self.client_cert_auth:
            args += ["--client-cert-auth", "--trusted-ca-file", self.pki.ca]
        if self.auth_token_ttl_s is not None:
            args += ["--auth-token-ttl", str(self.auth_token_ttl_s)]
        return args

    def _health_context(self) -> ssl.SSLContext:
        return self._context()

    def call(self, path: str, body: dict, token: str = "") -> tuple[int, dict]:
        """One gateway call as a test-side admin: (HTTP status, JSON answer)."""
        headers = {"Content-Type": "application/json", **({"Authorization": token} if token else {})}
        req = urllib.request.Request(self.endpoint + path, data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=5, context=self._context()) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as exc:
            text = exc.read()
            try:
                return exc.code, json.loads(text)
            except ValueError:
                return exc.code, {"error": text.decode(errors="replace")}

    def _ok(self, path: str, body: dict, token: str = "") -> dict:
        status, answer = self.call(path, body, token)
        if status != 200 or "error" in answer:
            raise RuntimeError(f"etcd {path} answered {status} {answer}")
        return answer

    def enable_auth(self, user: str, password: str, root_password: str = "root-secret",
                    prefix: str = PREFIX) -> None:
        """root (role root), `user` with read/write on `prefix` only, then auth on."""
        self._ok("/v3/auth/user/add", {"name": "root", "password": root_password})
        self._ok("/v3/auth/user/grant", {"user": "root", "role": "root"})
        self._ok("/v3/auth/role/add", {"name": "kvstore-members"})
        self._ok("/v3/auth/role/grant",
                 {"name": "kvstore-members", "perm": {"permType": "READWRITE", **_range(prefix)}})
        self._ok("/v3/auth/user/add", {"name": user, "password": password})
        self._ok("/v3/auth/user/grant", {"user": user, "role": "kvstore-members"})
        self._ok("/v3/auth/enable", {})
        self._root_password = root_password

    def member_ids(self, prefix: str = PREFIX) -> list[str]:
        """The node ids registered under `prefix`, read as root (a fresh login: tokens expire and a restart
        forgets them)."""
        token = self._ok("/v3/auth/authenticate", {"name": "root", "password": self._root_password})["token"]
        answer = self._ok("/v3/kv/range", _range(prefix), token)
        return sorted(base64.b64decode(kv["key"]).decode()[len(prefix):] for kv in answer.get("kvs", []))
