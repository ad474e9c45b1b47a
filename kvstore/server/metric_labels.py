"""Namespace and tenant names as metric label values: the names themselves, keyed hashes of them, or none.

Why: namespace names carry model ids and tenants' cache salts, tenant names are customer names, and the
metrics port is plain HTTP without authentication that a host-network DaemonSet opens on the node's
addresses. So with tokens (a multi-tenant node) the default (`metrics_namespace_labels = "auto"`) is "hash":
  name   today's label values, for single-tenant nodes and trusted networks;
  hash   label = "h-" + the first 16 hex digits of HMAC-SHA256(key, kind + b"\\0" + UTF-8 name), kind being
         b"namespace" or b"tenant" (so a tenant and a namespace of the same name get unrelated labels).
         Series stay separate, so per-namespace hit rates and per-tenant usage still chart; who they are does
         not leave the node. A plain hash would not do: names are guessable (model ids, tenant names), and
         anyone could hash a list of likely names and match them; the HMAC key is not on the wire;
  none   the per-namespace and per-tenant families are left out; the daemon-wide totals stay.
The "_other" bucket (namespaces past the label cap) stays "_other" in every mode: it names nobody.

The key, and the trade-off between linking and unlinking:
  - `metrics_label_key_file = ""`: 32 random bytes at each start. Labels change at every restart and differ
    between nodes: nothing links a series before and after a restart, or across nodes, and nobody (the
    operator included) can map a label back to a name. Dashboards per instance still work.
  - a key file (owner-only, >= 16 bytes): the same labels across restarts, and across nodes that share the
    file (fleet-wide `sum by (tenant)` works); whoever holds the key can map a name to its label:
    `python -m kvstore.server.metric_labels --key-file FILE --tenant alice --namespace 'model@abc/alice'`.
    A leaked key turns the labels back into names for anyone with a list of candidates: rotate it then.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import sys
from collections.abc import Sequence

from kvstore.errors import ConfigError
from kvstore.security.files import check_private_file, unreadable

__all__ = ["MetricLabels", "MODES", "label_hash", "read_label_key", "MIN_KEY_BYTES"]

MODES = ("name", "hash", "none")
MIN_KEY_BYTES = 16
_KINDS = ("namespace", "tenant")


def read_label_key(path: str) -> bytes:
    """The secret of an owner-only key file: its bytes, surrounding whitespace stripped."""
    check_private_file(path, "metrics_label_key_file")
    try:
        with open(path, "rb") as fh:
            key = fh.read().strip()
    except OSError as exc:
        raise unreadable("metrics_label_key_file", path, exc) from exc
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"metrics_label_key_file {path} holds {len(key)} bytes, fewer than {MIN_KEY_BYTES}: "
                          f"write a random key, e.g. `head -c 32 /dev/urandom | base64 > {path}; chmod 600 {path}`")
    return key


def label_hash(key: bytes, kind: str, name: str) -> str:
    """The documented label of `name` (kind: namespace or tenant) under `key`."""
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    digest = hmac.new(key, kind.encode() + b"\0" + name.encode(), hashlib.sha256).hexdigest()
    return "h-" + digest[:16]


class MetricLabels:
    """How one daemon writes namespace and tenant names into label values (one instance per metrics server)."""

    def __init__(self, mode: str = "name", key: bytes | None = None) -> None:
        if mode not in MODES:
            raise ConfigError(f"metrics_namespace_labels={mode!r}: use one of {', '.join(MODES)}")
        self.mode = mode
        self.keyed_from_file = key is not None
        self._key = key if key is not None else os.urandom(32)  # never logged, never served

    @classmethod
    def load(cls, mode: str, key_file: str = "") -> MetricLabels:
        return cls(mode, read_label_key(key_file) if key_file else None)

    @property
    def per_name(self) -> bool:
        """False: leave out the families labelled by namespace or tenant."""
        return self.mode != "none"

    def namespace(self, name: str) -> str:
        return self._label("namespace", name)

    def tenant(self, name: str) -> str:
        return self._label("tenant", name)

    def _label(self, kind: str, name: str) -> str:
        if self.mode == "name" or not name:  # '' (no tenant) names nobody
            return name
        return label_hash(self._key, kind, name)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstore.server.metric_labels",
                                description="Print the hash label of tenants and namespaces under a "
                                "metrics_label_key_file, to find their series on a dashboard.")
    p.add_argument("--key-file", required=True, help="the daemon's metrics_label_key_file")
    p.add_argument("--tenant", action="append", default=[], help="a tenant name (repeatable)")
    p.add_argument("--namespace", action="append", default=[], help="a namespace name (repeatable)")
    args = p.parse_args(argv)
    try:
        key = read_label_key(args.key_file)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    for kind, names in (("tenant", args.tenant), ("namespace", args.namespace)):
        for name in names:
            print(f"{kind}\t{name}\t{label_hash(key, kind, name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
