"""A throwaway PKI for the security tests: one CA, a server/peer certificate for 127.0.0.1 and localhost, a
client certificate, and a rogue CA with its own client certificate (signed by nobody the daemon trusts)."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvstore.security.tls import TlsFiles


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: str, data: bytes, mode: int = 0o644) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.chmod(path, mode)
    return path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert(subject: str, key, issuer_name: x509.Name, issuer_key, *, ca: bool, server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                            critical=False)
    if not ca:
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                            critical=False)
    return b.sign(issuer_key, hashes.SHA256())


@dataclass(frozen=True)
class Pki:
    ca: str
    server: TlsFiles        # cert + key (+ ca): the daemon's and the peers' identity
    client: TlsFiles        # a client certificate the CA signed (+ the CA to verify the daemon)
    rogue_client: TlsFiles  # a client certificate from another CA (+ the right CA to verify the daemon)


def make_pki(directory: str) -> Pki:
    os.makedirs(directory, mode=0o700, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _cert("kvstore-test-ca", ca_key, _name("kvstore-test-ca"), ca_key, ca=True)
    ca = _write(os.path.join(directory, "ca.pem"), ca_cert.public_bytes(serialization.Encoding.PEM))
    out: dict[str, TlsFiles] = {}
    rogue_key = ec.generate_private_key(ec.SECP256R1())
    for name, issuer_key, issuer, server in (("server", ca_key, ca_cert, True), ("client", ca_key, ca_cert, False),
                                             ("rogue", rogue_key, None, False)):
        key = ec.generate_private_key(ec.SECP256R1())
        issuer_name = issuer.subject if issuer is not None else _name("rogue-ca")
        cert = _cert(f"kvstore-{name}", key, issuer_name, issuer_key, ca=False, server=server)
        out[name] = TlsFiles(_write(os.path.join(directory, f"{name}.pem"), cert.public_bytes(serialization.Encoding.PEM)),
                             _write(os.path.join(directory, f"{name}-key.pem"), _key_pem(key), 0o600), ca)
    return Pki(ca, out["server"], out["client"], out["rogue"])
