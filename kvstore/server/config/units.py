"""Values written as text in the config: sizes ('512MiB') and per-tenant quota lists ('alice=8GiB,*=1GiB')."""

from __future__ import annotations

import re

from kvstore.errors import ConfigError
from kvstore.security.tokens import TENANT_RE

__all__ = ["parse_size", "parse_quotas"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(value: str | int, name: str = "size") -> int:
    """'1GiB', '512 MiB', '4096' or an int -> bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size such as '1GiB', got {value!r}")
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{name}: cannot read {value!r} as a size; use e.g. 4096, '512MiB', '1GiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_quotas(text: str, name: str) -> dict[str, int]:
    """'alice=8GiB, bob=2GiB, *=1GiB' -> {'alice': ..., 'bob': ..., '*': ...}."""
    out: dict[str, int] = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        tenant, sep, size = item.partition("=")
        tenant = tenant.strip()
        if not sep or not (tenant == "*" or TENANT_RE.match(tenant)):
            raise ConfigError(f"{name}: cannot read {item!r}; use tenant=size pairs, e.g. 'alice=8GiB,*=1GiB'")
        if tenant in out:
            raise ConfigError(f"{name}: tenant {tenant!r} given twice")
        out[tenant] = parse_size(size.strip(), f"{name} of {tenant}")
    return out
