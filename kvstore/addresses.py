"""host:port values of the config: one reader for every listener and advertised address.

Why one module: the daemon binds `listen`, `metrics_listen` and `peer_listen`, and tells peers to dial
`peer_advertise` / `peer_control_advertise`. In Kubernetes these come from the downward API through
`$(HOST_IP)` in a KVSTORE_* variable; a variable the pod does not define stays the literal text `$(HOST_IP)`,
which a bare `rpartition(":")` accepts as a host. Each value is read here once, and a bad one is named with
what would be accepted. Addresses peers dial must also name one host: a wildcard (0.0.0.0, ::) binds every
interface but tells peers to dial themselves.
"""

from __future__ import annotations

import ipaddress
import re

__all__ = ["HostPort", "parse_host_port", "is_wildcard"]

# RFC 1123 host names: labels of letters, digits and inner hyphens, dot-separated
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


class HostPort(tuple[str, int]):
    """(host, port); host without IPv6 brackets."""

    @property
    def host(self) -> str:
        return self[0]

    @property
    def port(self) -> int:
        return self[1]


def _is_host_name(host: str) -> bool:
    return len(host) <= 253 and all(_LABEL.fullmatch(label) for label in host.rstrip(".").split("."))


def parse_host_port(value: str, *, lowest_port: int = 1) -> HostPort:
    """`host:port`, `[v6]:port` -> HostPort; ValueError saying what is wrong otherwise.

    host: an IPv4 or IPv6 address (IPv6 in brackets) or a host name; port: lowest_port..65535 (0 lets the kernel
    pick, for a listener only)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ValueError("expected host:port")
    if not port.isdigit() or not lowest_port <= int(port) < 65536:
        raise ValueError(f"port {port!r} is not a number in {lowest_port}..65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"{host} is not an IPv6 address") from None
        return HostPort((host[1:-1], int(port)))
    if ":" in host:
        raise ValueError(f"{host!r} looks like an IPv6 address: write it in brackets, [{host}]:{port}")
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        if re.fullmatch(r"[0-9.]+", host) or not _is_host_name(host):
            hint = " (an unset variable of the pod's env?)" if "$" in host else ""
            raise ValueError(f"{host!r} is not an IP address or host name{hint}") from None
    return HostPort((host, int(port)))


def is_wildcard(host: str) -> bool:
    """0.0.0.0 or :: : a listener on every interface, an address nobody can dial."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False
