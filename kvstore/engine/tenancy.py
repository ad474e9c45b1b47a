"""Engine methods for tenants: quota-aware victim choice (quotas.py has the rules) and the ownership lookups
the service's tenant checks use (kvstore/server/tenancy.py). Called under / taking the engine's one lock, like
the rest of the engine; split out only to keep engine.py readable."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore.engine.quotas import TenantQuotas

if TYPE_CHECKING:
    from kvstore.engine.engine import Engine

__all__ = ["TenancyMixin"]


class TenancyMixin:
    def _choose_quota_victim(self: Engine, eligible: Callable[[int], bool], tenant: str | None,
                             own_pass: bool = True) -> int | None:
        """Over-quota tenants' blocks first, then (allocation only) the acting tenant's own; see quotas.py."""
        assert self._quotas is not None
        cat = self._cat
        tenant_of = lambda eid: cat.namespace_of(eid).tenant  # noqa: E731
        over = self._quotas.over_quota(TenantQuotas.usage(cat.namespaces), tenant_of, lambda eid: int(cat.size[eid]))
        victim = self._choose_victim(lambda eid: eligible(eid) and over(eid))
        if victim is None and own_pass and tenant is not None:
            victim = self._choose_victim(lambda eid: eligible(eid) and tenant_of(eid) == tenant)
        return victim

    def tenant_usage(self: Engine) -> dict[str, int]:
        """RAM payload bytes per tenant (what quotas compare against)."""
        with self._lock:
            return TenantQuotas.usage(self._cat.namespaces)

    def namespace_owner(self: Engine, name: str) -> tuple[str, bool] | None:
        """(tenant, recovered) of a namespace; None when unknown. `recovered`: known only from the disk tier
        after a restart, not yet registered again (its tenant is not known to the engine)."""
        with self._lock:
            ns = self._cat.by_name.get(name)
            return None if ns is None else (ns.tenant, ns.recovered)

    def reservation_namespace(self: Engine, reservation_id: int) -> str | None:
        with self._lock:
            payload = self._reservations.get(reservation_id)
            return None if payload is None else payload[0].name

    def lease_namespace(self: Engine, lease_id: int) -> str | None:
        with self._lock:
            ids = self._leases.get(lease_id)
            if ids is None or not len(ids):
                return None
            return self._cat.namespace_of(int(ids[0])).name
