"""Per-tenant usage next to the quotas, for Stats (a token sees its own row) and the metrics endpoint.

Usage is summed over namespaces by their owner (TenantGuard.owner_of, which also knows the owners of namespaces
recovered from disk after a restart): RAM payload bytes as RAM quotas count them, disk footprint as the disk
tier's quotas count it. Tenants named in a quota appear with zero usage too, so a dashboard shows every
guarantee.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvstore.engine.quotas import TenantQuotas
from kvstore.engine.results import NamespaceUsage

__all__ = ["TenantRow", "TenantUsage"]


@dataclass(frozen=True)
class TenantRow:
    tenant: str
    ram_bytes: int
    ram_quota_bytes: int
    disk_bytes: int
    disk_quota_bytes: int


class TenantUsage:
    def __init__(self, owner_of: Callable[[str], str], ram: TenantQuotas, disk: TenantQuotas) -> None:
        self._owner_of = owner_of
        self._ram = ram
        self._disk = disk

    def rows(self, namespaces: Iterable[NamespaceUsage], only: str | None = None) -> list[TenantRow]:
        """One row per tenant with usage or a named quota, sorted by tenant; `only`: that tenant's row alone."""
        ram: dict[str, int] = {}
        disk: dict[str, int] = {}
        for n in namespaces:
            t = self._owner_of(n.name)
            ram[t] = ram.get(t, 0) + n.bytes
            disk[t] = disk.get(t, 0) + n.disk_bytes
        named = (set(self._ram.snapshot()) | set(self._disk.snapshot())) - {"*"}
        tenants = sorted(set(ram) | named)
        if only is not None:
            tenants = [t for t in tenants if t == only] or [only]
        return [TenantRow(t, ram.get(t, 0), self._ram.quota(t), disk.get(t, 0), self._disk.quota(t)) for t in tenants]
