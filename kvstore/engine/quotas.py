"""Per-tenant RAM quotas: a guaranteed share of the arena that another tenant's burst cannot evict.

A quota is a floor, not a cap: a tenant may use more RAM while it is free, and that excess is what others
evict first. Usage is the committed payload bytes of the tenant's namespaces in RAM (`Namespace.bytes`);
reserved and promoting slots are not counted. Eviction with quotas (RamSpace.allocate and the watermark pass):

    pass 1  victims whose tenant stays at or above its quota after losing the block ("over quota"); the
            acting tenant's own blocks are in this pass only when it is over its own quota
    pass 2  (allocation only) the acting tenant's own blocks, even below its quota: evicting yourself is fine
    then    StoreFullError: a tenant at its quota gets "store full" rather than evicting others

A tenant without a quota (and no '*' default) has a quota of 0, so its blocks are always evictable, and with
no quotas configured none of this runs: eviction is exactly the policy's order, as before.
Not thread-safe: the engine calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

__all__ = ["TenantQuotas"]


class _Holder(Protocol):
    """What usage() reads of a namespace (catalog.Namespace), named here so quotas imports nothing of the engine."""

    tenant: str
    bytes: int


class TenantQuotas:
    def __init__(self, quotas: Mapping[str, int] | None = None) -> None:
        self._quotas = dict(quotas or {})
        self._default = self._quotas.pop("*", 0)

    @property
    def enabled(self) -> bool:
        return bool(self._quotas) or self._default > 0

    def quota(self, tenant: str) -> int:
        return self._quotas.get(tenant, self._default)

    def snapshot(self) -> dict[str, int]:
        return {**self._quotas, **({"*": self._default} if self._default else {})}

    @staticmethod
    def usage(namespaces: Iterable[_Holder]) -> dict[str, int]:
        out: dict[str, int] = {}
        for ns in namespaces:
            out[ns.tenant] = out.get(ns.tenant, 0) + ns.bytes
        return out

    def over_quota(self, usage: Mapping[str, int], tenant_of: Callable[[int], str],
                   size_of: Callable[[int], int]) -> Callable[[int], bool]:
        """eid -> True when evicting it leaves its tenant at or above its quota."""
        def ok(eid: int) -> bool:
            t = tenant_of(eid)
            return usage.get(t, 0) - size_of(eid) >= self.quota(t)
        return ok
