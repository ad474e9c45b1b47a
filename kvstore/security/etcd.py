"""How this node proves itself to etcd and checks that it talks to the real etcd: TLS material and a user.

Membership is the cluster's routing table: whoever can write under `etcd_prefix` can join the cluster and
have peers push blocks to an address of its choosing, and whoever can impersonate etcd can hand this node a
member set of its own. So, on https:// endpoints:
  - etcd's certificate is verified against `ca` (the system CA store when `ca` is empty) and its host name or
    IP against the endpoint URL, always (there is no switch to turn that off);
  - `cert` + `key` present a client certificate (etcd's --client-cert-auth);
and on any endpoint `user` + `password_file` log in with etcd's own authentication (etcd --auth: roles limit
the user to the member prefix). The password is read from an owner-only file, like tokens_file and tls_key,
and never taken from a flag, logged, or kept in the config object: it is read when a token is needed.

etcd's JSON gateway (what kvstore/peer/etcd.py speaks) refuses a client certificate that has a CommonName once
etcd's auth is on ("CommonName of client sending a request against gateway will be ignored"): with both, use
a certificate without a CN (e.g. subject O=kvstore) and log in with the user.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from kvstore.errors import ConfigError
from kvstore.security.files import check_private_file, unreadable

__all__ = ["EtcdSecurity"]


def _readable(path: str, what: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise unreadable(what, path, exc) from exc


@dataclass(frozen=True)
class EtcdSecurity:
    """Paths and a user name; empty strings mean 'not given'."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""
    password_file: str = ""

    @property
    def tls_files_given(self) -> bool:
        return bool(self.ca or self.cert or self.key)

    def check(self) -> None:
        """Loud, early errors: files readable, secrets owner-only, halves given together."""
        if bool(self.cert) != bool(self.key):
            raise ConfigError(f"etcd_cert and etcd_key go together (got etcd_cert={self.cert!r} "
                              f"etcd_key={self.key!r}): give both for a client certificate, or neither")
        if bool(self.user) != bool(self.password_file):
            raise ConfigError("etcd_user and etcd_password_file go together: the user logs in with the password "
                              "in that owner-only file (a password is never taken from a flag)")
        if self.user and (self.user != self.user.strip() or not self.user.isprintable() or ":" in self.user):
            raise ConfigError(f"etcd_user={self.user!r}: use the plain etcd user name (no spaces or ':')")
        for path, what in ((self.ca, "etcd_ca"), (self.cert, "etcd_cert")):
            if path:
                _readable(path, what)
        if self.key:
            check_private_file(self.key, "etcd_key")
        if self.password_file:
            self.password()

    def password(self) -> str:
        """The first line of the owner-only password file (read on every login, so a rotated file is picked
        up at the next one)."""
        check_private_file(self.password_file, "etcd_password_file")
        try:
            with open(self.password_file, encoding="utf-8") as fh:
                text = fh.readline().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"etcd_password_file {self.password_file}: cannot read it ({exc})") from exc
        if not text:
            raise ConfigError(f"etcd_password_file {self.password_file} is empty: put the etcd password of "
                              f"{self.user!r} on its first line")
        return text

    def ssl_context(self) -> ssl.SSLContext:
        """Client side of https:// endpoints: verify etcd (CA + host name), present our certificate if given."""
        try:
            ctx = ssl.create_default_context(cafile=self.ca or None)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            if self.cert:
                ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"etcd TLS files (etcd_ca={self.ca!r}, etcd_cert={self.cert!r}): cannot load them "
                              f"({exc}); give PEM files") from exc
        return ctx
