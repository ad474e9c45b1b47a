"""A minimal etcd v3 client over etcd's JSON gateway (HTTP POST /v3/...), with the standard library only.

Why not a gRPC etcd client: `etcd3` 0.12 breaks on protobuf >= 4 and this daemon pins protobuf 7 for its own
stubs; `aetcd` is asyncio-only and ships its own generated stubs, another protobuf coupling to keep in step.
Membership needs five calls (lease grant / keepalive / revoke, put, prefix range), each a tiny JSON POST that
every etcd >= 3.4 serves on its client port, so urllib is enough and nothing can drift against our protobuf,
and one watch: the gateway streams a watch's answers as newline-separated JSON objects on one long POST
(`open_stream`; etcd_watch.py reads them), so a member that joins or leaves is seen at once by every node and
etcd's load does not grow with nodes x refresh rate.

Security (kvstore/security/etcd.py says why it matters): https:// endpoints verify etcd's certificate and host
name against `etcd_ca` (or the system store) and may present a client certificate; with `etcd_user` the
client logs in (POST /v3/auth/authenticate) and sends the token it gets as the `Authorization` header. A token
etcd no longer accepts (TTL passed: etcd --auth-token-ttl, 300 s by default, counted from its last use; etcd
restarted, which forgets simple tokens; another member, which never knew a simple token; the auth store
changed) is answered "invalid auth token" or "revision of auth store is old": the client logs in again once
and repeats the call. Each call opens its own connection (a TLS handshake costs well under a millisecond of
the `peer_refresh_s` tick).

Errors:
    EtcdUnavailable     no endpoint answered, or an answer we could not read; retried on the next tick
    └── EtcdRefused     etcd answered and said no: certificate not trusted (either way), wrong password,
                        no permission on the prefix, authentication required. The message names the setting
                        to fix; the caller keeps serving and retries (the fix may land on etcd's side).
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import TypeVar
from urllib.parse import urlsplit

from kvstore.errors import ConfigError
from kvstore.security.etcd import EtcdSecurity
from kvstore.security.tls import is_loopback_host

__all__ = ["EtcdClient", "EtcdUnavailable", "EtcdRefused"]

T = TypeVar("T")

log = logging.getLogger(__name__)


class EtcdUnavailable(Exception):
    """No endpoint answered the call (down, unreachable, or an answer we could not read)."""


class EtcdRefused(EtcdUnavailable):
    """etcd answered and refused us: a configuration to fix (CA, client certificate, user, password, role)."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _prefix_end(prefix: bytes) -> bytes:
    """The range end that selects every key starting with `prefix` (etcd's convention: last byte + 1)."""
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    if not p:
        return b"\x00"
    p[-1] += 1
    return bytes(p)


def _error_of(status: int, answer: dict) -> str | None:
    """etcd's error text, from a unary answer ({"error": "...", "code": n} with an HTTP error status) or a
    stream's (lease keepalive: HTTP 200 with {"error": {"grpc_code": n, "message": "..."}}); None when fine."""
    err = answer.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err)
    if err:
        return str(err).strip()
    if status != 200:
        return f"HTTP {status}"
    return None


# etcd's answers that mean "log in again", and the ones that mean "this configuration is refused"
_RELOGIN = ("invalid auth token", "revision of auth store is old", "user name is empty")
_CN_REFUSED = "CommonName of client sending a request against gateway"


class EtcdClient:
    def __init__(self, endpoints: Sequence[str], timeout_s: float = 1.0, security: EtcdSecurity | None = None) -> None:
        if not endpoints:
            raise ValueError("EtcdClient needs at least one endpoint")
        self._endpoints = [e.rstrip("/") for e in endpoints]
        self._timeout = timeout_s
        self._preferred = 0  # the endpoint that answered last: tried first next time
        self._security = security or EtcdSecurity()
        https = any(e.startswith("https://") for e in self._endpoints)
        self._context = self._security.ssl_context() if https else None
        plain = [e for e in self._endpoints
                 if e.startswith("http://") and not is_loopback_host(urlsplit(e).hostname or "")]
        if plain:  # server/config/security.py lets this through only on an unprotected node or with allow_insecure_remote
            log.warning("SECURITY: etcd %s %s plain http to another host: anyone on the path can rewrite the member "
                        "set (use https:// with etcd_ca)", ", ".join(plain), "is" if len(plain) == 1 else "are")
        self._lock = threading.Lock()  # one call at a time: the token and the preferred endpoint are shared
        self._token = ""                # guarded by _lock; never logged
        self._login_needed = bool(self._security.user)  # False while etcd says its auth is off
        self.logins = 0                 # successful logins (the first one and every refresh)

    # -- transport -----------------------------------------------------------------------------------------
    def _send(self, endpoint: str, path: str, body: dict, token: str) -> tuple[int, dict]:
        """(HTTP status, JSON answer) from one endpoint; transport failures raise EtcdUnavailable/EtcdRefused."""
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = token  # etcd takes the bare token (no "Bearer")
        req = urllib.request.Request(endpoint + path, data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self._timeout, context=self._context) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise self._transport_error(endpoint, exc) from exc
        try:
            answer = json.loads(raw or b"{}")
        except ValueError:
            answer = {"error": raw.decode(errors="replace")[:300]}
        return status, answer if isinstance(answer, dict) else {"error": repr(answer)[:300]}

    def _transport_error(self, endpoint: str, exc: BaseException) -> EtcdUnavailable:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc  # (SSLError.reason is a str)
        if isinstance(reason, ssl.SSLCertVerificationError):
            trust = f"etcd_ca={self._security.ca}" if self._security.ca else "the system CA store (etcd_ca is empty)"
            return EtcdRefused(f"etcd {endpoint}: its TLS certificate does not verify against {trust}: "
                               f"{reason.verify_message or reason}; set etcd_ca to the CA that signed etcd's "
                               "certificate, and use a host name or IP the certificate names")
        if isinstance(reason, ssl.SSLError) and any(
                alert in str(reason) for alert in ("BAD_CERTIFICATE", "CERTIFICATE_REQUIRED", "UNKNOWN_CA")):
            mine = (f"etcd_cert={self._security.cert}" if self._security.cert else "no client certificate")
            return EtcdRefused(f"etcd {endpoint} refused this node's TLS client certificate ({mine}): etcd runs with "
                               "--client-cert-auth; set etcd_cert and etcd_key to a certificate signed by the CA "
                               f"etcd trusts (--trusted-ca-file) [{reason}]")
        hint = ""
        if endpoint.startswith("http://") and isinstance(reason, ConnectionResetError):  # a close or a reset
            hint = " (an etcd that serves TLS closes plain http connections: use https:// and etcd_ca)"
        elif isinstance(reason, ssl.SSLError) and "WRONG_VERSION_NUMBER" in str(reason):
            hint = " (this endpoint does not speak TLS: use http://, or turn TLS on in etcd)"
        elif isinstance(reason, ssl.SSLEOFError):  # TLS 1.3: a refused client certificate may look like this
            hint = (" (etcd cut the TLS connection: with --client-cert-auth it needs a client certificate: set "
                    "etcd_cert and etcd_key; or this endpoint is plain http: use http://)" if not self._security.cert
                    else " (etcd cut the TLS connection: is etcd_cert signed by the CA etcd trusts?)")
        return EtcdUnavailable(f"etcd {endpoint}: {reason}{hint}")

    # -- authentication --------------------------------------------------------------------------------------
    def _login(self, endpoint: str, why: str) -> None:
        try:
            password = self._security.password()
        except ConfigError as exc:  # the file changed since startup: say so, keep serving, retry next tick
            raise EtcdRefused(str(exc)) from None
        status, answer = self._send(endpoint, "/v3/auth/authenticate",
                                    {"name": self._security.user, "password": password}, "")
        err = _error_of(status, answer)
        if err and "authentication is not enabled" in err:  # calls go without a token until etcd asks for one
            log.warning("etcd %s has authentication off: etcd_user %r is not needed there (anyone who reaches etcd "
                        "can change the member set: turn on etcd's auth)", endpoint, self._security.user)
            self._token = ""
            self._login_needed = False
            return
        if err:
            raise self._refusal(endpoint, "/v3/auth/authenticate", err)
        token = answer.get("token")
        if not isinstance(token, str) or not token:
            raise EtcdUnavailable(f"etcd {endpoint}: login answered without a token")
        self._token = token
        self.logins += 1
        if why:
            log.info("etcd %s: %s; logged in again as %r", endpoint, why, self._security.user)
        else:
            log.info("etcd %s: logged in as %r", endpoint, self._security.user)

    def _refusal(self, endpoint: str, path: str, err: str) -> EtcdUnavailable:
        user = self._security.user
        if "invalid user ID or password" in err:
            return EtcdRefused(f"etcd {endpoint}: login as {user!r} failed (wrong password or unknown user): "
                               "check etcd_user and the password in etcd_password_file")
        if _CN_REFUSED in err:
            return EtcdRefused(f"etcd {endpoint} refuses a client certificate with a CommonName while its auth is "
                               f"on (etcd_cert={self._security.cert}): issue etcd_cert without a CN (e.g. subject "
                               "O=kvstore) and log in with etcd_user, or turn etcd's auth off")
        if "permission denied" in err or "user name is empty" in err:
            if user:
                return EtcdRefused(f"etcd {endpoint}: user {user!r} may not call {path} ({err}): grant its role "
                                   "readwrite on the etcd_prefix range")
            return EtcdRefused(f"etcd {endpoint} requires authentication ({err}): set etcd_user and "
                               "etcd_password_file")
        if "authentication failed" in err:
            return EtcdRefused(f"etcd {endpoint} refused {path}: {err}")
        return EtcdUnavailable(f"etcd {endpoint} {path}: {err}")

    def _call(self, endpoint: str, path: str, body: dict) -> dict:
        """One call on one endpoint, logging in first when a user is set and again once if the token is stale."""
        if self._login_needed and not self._token:
            self._login(endpoint, "")
        sent = self._token
        status, answer = self._send(endpoint, path, body, sent)
        err = _error_of(status, answer)
        # a stale token, or none sent because etcd's auth was off and has been turned on since (then etcd says
        # "permission denied" to a client certificate without a user, "user name is empty" otherwise)
        if err and self._security.user and (any(text in err for text in _RELOGIN)
                                            or (not sent and "permission denied" in err)):
            self._token = ""
            self._login_needed = True
            self._login(endpoint, f"etcd answered {err!r}")
            status, answer = self._send(endpoint, path, body, self._token)
            err = _error_of(status, answer)
        if err:
            raise self._refusal(endpoint, path, err)
        return answer

    def _post(self, path: str, body: dict) -> dict:
        return self._first(lambda endpoint: self._call(endpoint, path, body))

    def _first(self, fn: Callable[[str], T]) -> T:
        """fn on the endpoints in turn, the preferred one first, until one answers; all failing raises the most
        telling failure (a refusal says more than a down endpoint) with every endpoint's reason."""
        with self._lock:
            errors: list[EtcdUnavailable] = []
            n = len(self._endpoints)
            for i in range(n):
                idx = (self._preferred + i) % n
                try:
                    answer = fn(self._endpoints[idx])
                except EtcdUnavailable as exc:
                    errors.append(exc)
                    continue
                self._preferred = idx
                return answer
        refused = [e for e in errors if isinstance(e, EtcdRefused)]
        first = refused[0] if refused else errors[0]
        raise type(first)("; ".join(str(e) for e in (refused or errors))) from first

    # -- etcd calls ------------------------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> int:
        """A new lease with this TTL (seconds, >= 1); its id."""
        answer = self._post("/v3/lease/grant", {"TTL": max(1, int(ttl_s))})
        try:
            return int(answer["ID"])
        except (KeyError, ValueError) as exc:
            raise EtcdUnavailable(f"etcd lease grant answered {answer!r}") from exc

    def keepalive(self, lease_id: int) -> int:
        """Renew a lease; its remaining TTL, 0 when it no longer exists (expired or revoked)."""
        answer = self._post("/v3/lease/keepalive", {"ID": str(lease_id)})
        return int(answer.get("result", {}).get("TTL", 0) or 0)

    def revoke(self, lease_id: int) -> None:
        self._post("/v3/lease/revoke", {"ID": str(lease_id)})

    def put(self, key: bytes, value: bytes, lease_id: int = 0) -> None:
        body: dict[str, object] = {"key": _b64(key), "value": _b64(value)}
        if lease_id:
            body["lease"] = str(lease_id)
        self._post("/v3/kv/put", body)

    def range_prefix(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """Every (key, value) under `prefix`."""
        return self.range_prefix_at(prefix)[1]

    def range_prefix_at(self, prefix: bytes, end: bytes | None = None) -> tuple[int, list[tuple[bytes, bytes]]]:
        """(the store's revision of the answer, every (key, value) under `prefix`, or in [prefix, end)): a watch
        from revision + 1 then misses no change and repeats none."""
        answer = self._post("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(end or _prefix_end(prefix))})
        try:
            revision = int(answer.get("header", {}).get("revision", 0))
            return revision, [(base64.b64decode(kv["key"]), base64.b64decode(kv.get("value", "")))
                              for kv in answer.get("kvs", [])]
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            raise EtcdUnavailable(f"etcd range answered {answer!r}") from exc

    def count_prefix(self, prefix: bytes) -> int:
        """How many keys start with `prefix` (etcd counts; no key or value crosses the wire)."""
        answer = self._post("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix)),
                                             "count_only": True})
        try:
            return int(answer.get("count", 0))
        except (ValueError, TypeError, AttributeError) as exc:
            raise EtcdUnavailable(f"etcd count answered {answer!r}") from exc

    def delete(self, key: bytes) -> None:
        self._post("/v3/kv/deleterange", {"key": _b64(key)})

    @staticmethod
    def prefix_end(prefix: bytes) -> bytes:
        return _prefix_end(prefix)

    # -- streams (watch) --------------------------------------------------------------------------------------
    def open_stream(self, path: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """A streaming POST on the first endpoint that answers 200 (the preferred one first): its connection
        (close it, or shut its socket down from another thread, to end the stream) and response (read it a line
        at a time). Logs in first where a user is set; a refusal raises EtcdRefused, no answer EtcdUnavailable."""
        return self._first(lambda endpoint: self._open_one(endpoint, path, body))

    def _open_one(self, endpoint: str, path: str,
                  body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        if self._login_needed and not self._token:
            self._login(endpoint, "")
        parts = urlsplit(endpoint)
        conn: http.client.HTTPConnection
        if parts.scheme == "https":
            conn = http.client.HTTPSConnection(parts.hostname or "", parts.port, timeout=self._timeout,
                                               context=self._context)
        else:
            conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=self._timeout)
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = self._token
        try:
            conn.request("POST", path, body=json.dumps(body).encode(), headers=headers)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException, ValueError) as exc:
            conn.close()
            raise self._transport_error(endpoint, exc) from exc
        if resp.status != 200:
            raw = resp.read()
            conn.close()
            try:
                answer = json.loads(raw or b"{}")
            except ValueError:
                answer = {"error": raw.decode(errors="replace")[:300]}
            err = _error_of(resp.status, answer if isinstance(answer, dict) else {}) or f"HTTP {resp.status}"
            if self._security.user and any(text in err for text in _RELOGIN):
                self._token = ""  # the next open logs in again
            raise self._refusal(endpoint, path, err)
        return conn, resp
