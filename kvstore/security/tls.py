"""TLS material from three paths (certificate chain, private key, CA bundle) turned into what each transport
needs: gRPC server/channel credentials and ssl.SSLContexts for the peer TCP data plane.

Mutual TLS: the daemon's control plane requires a client certificate signed by `ca` whenever a CA is given;
the peer data plane always requires one on both sides (peers are nodes, and a node proves itself with its
certificate: there is no token on the data port). The unix socket never uses TLS: it is owner-only (0600 in a
0700 directory) and local.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
from dataclasses import dataclass

import grpc

from kvstore.errors import ConfigError
from kvstore.security.files import check_private_file, unreadable

__all__ = ["TlsFiles", "is_loopback_address", "is_loopback_host"]


def is_loopback_host(host: str) -> bool:
    """Literal loopback addresses and 'localhost' only; any other name may resolve anywhere."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback_address(address: str) -> bool:
    """host:port (or unix:/path, which is local by definition)."""
    if address.startswith(("unix:", "/")):
        return True
    host, _, _ = address.rpartition(":")
    return is_loopback_host(host)


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise unreadable(what, path, exc) from exc


@dataclass(frozen=True)
class TlsFiles:
    """Paths of one side's TLS material; empty strings mean 'not given'."""

    cert: str = ""
    key: str = ""
    ca: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key or self.ca)

    @property
    def has_identity(self) -> bool:
        return bool(self.cert and self.key)

    def check(self, side: str, *, need_identity: bool, need_ca: bool) -> None:
        """Loud, early errors: a half-configured TLS setup never silently falls back to plaintext."""
        if bool(self.cert) != bool(self.key):
            raise ConfigError(f"{side}: tls_cert and tls_key go together (got cert={self.cert!r} key={self.key!r})")
        if need_identity and not self.has_identity:
            raise ConfigError(f"{side}: TLS needs tls_cert and tls_key (PEM certificate chain and private key)")
        if need_ca and not self.ca:
            raise ConfigError(f"{side}: mutual TLS needs tls_ca (the PEM CA bundle that signs the other side)")
        for path, what in ((self.cert, "tls_cert"), (self.ca, "tls_ca")):
            if path:
                _read(path, what)
        if self.key:
            check_private_file(self.key, "tls_key")

    # -- gRPC -------------------------------------------------------------------------------------------
    def grpc_server_credentials(self) -> grpc.ServerCredentials:
        """Server identity; with a CA, clients must present a certificate it signed (mutual TLS)."""
        ca = _read(self.ca, "tls_ca") if self.ca else None
        return grpc.ssl_server_credentials([(_read(self.key, "tls_key"), _read(self.cert, "tls_cert"))],
                                           root_certificates=ca, require_client_auth=ca is not None)

    def grpc_channel_credentials(self) -> grpc.ChannelCredentials:
        """Trust `ca` (system roots when empty); present cert/key when given (mutual TLS)."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "tls_ca") if self.ca else None,
            private_key=_read(self.key, "tls_key") if self.key else None,
            certificate_chain=_read(self.cert, "tls_cert") if self.cert else None)

    # -- peer data plane (ssl module) ---------------------------------------------------------------------
    def server_context(self) -> ssl.SSLContext:
        """Data-plane listener: our certificate, and a peer certificate signed by the CA is required."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        ctx.load_verify_locations(self.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """Dialing a peer: verify its certificate (and its host name / IP SAN) against the CA; present ours."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_verify_locations(self.ca)
        ctx.load_cert_chain(self.cert, self.key)
        return ctx


def wrap_client(ctx: ssl.SSLContext, sock: socket.socket, host: str) -> ssl.SSLSocket:
    return ctx.wrap_socket(sock, server_hostname=host.strip("[]"))
