"""Per-tenant disk quotas at segment reclamation: a floor of disk bytes another tenant's burst cannot evict.

The disk tier is one FIFO log of segments, so it cannot choose victims across the store the way the RAM tier
does: the only blocks it can drop are those of the oldest segment. A quota therefore works at reclamation.
Walking the oldest segment in offset order, a record is

    kept      when dropping it would leave its tenant below its quota (usage - footprint < quota): it is
              copied to the head of the log like a second-chance record (reclaim.py), so the tenant keeps
              its bytes and they age again from the head;
    dropped   otherwise (usage falls by its footprint; the next record of that tenant sees the new usage).

Usage is the tenant's footprint on disk (page-rounded stored bytes of its namespaces' live records, from
SegmentTable.ns_bytes) plus what earlier reclamations of the same batch kept and have not committed yet.
So a tenant at or below its quota loses nothing; a tenant above it loses its oldest records down to the quota,
whoever's write caused the reclamation. The cost is write amplification: each pass of the log copies the
protected bytes once more (at most sum of quotas per capacity written).

Liveness: every reclamation must free something over a pass of the log, so the protected total
(sum over tenants of min(usage, quota)) must stay below capacity - 2 segments. The daemon's config refuses
quotas that could exceed that (server/config/security.py); if it happens anyway (a '*' quota and more
tenants than expected), `protect` returns nothing for that reclamation and counts it in
`quota_overcommitted`: the log stays FIFO rather than stall. Tenants come from the daemon (the namespace's
owner), resolved BEFORE the store takes its locks, so the engine's lock is never taken under the disk tier's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

__all__ = ["TenantFloors", "protect"]


@dataclass(frozen=True)
class TenantFloors:
    """tenant_of: namespace name -> tenant ('' when unknown); quota_of: tenant -> guaranteed disk bytes."""

    tenant_of: Callable[[str], str]
    quota_of: Callable[[str], int]

    def tenants(self, ns_names: Mapping[int, str]) -> dict[int, str]:
        """namespace id -> tenant, for the namespaces that hold records (called outside the store's locks)."""
        return {ns: self.tenant_of(name) for ns, name in ns_names.items()}

    def usage(self, ns_bytes: Mapping[int, int], tenants: Mapping[int, str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for ns, n in ns_bytes.items():
            t = tenants.get(ns, "")
            out[t] = out.get(t, 0) + n
        return out

    def protected_total(self, usage: Mapping[str, int]) -> int:
        return sum(min(n, self.quota_of(t)) for t, n in usage.items())


def protect(records: Iterable[tuple[bytes, int, int]], usage: dict[str, int], tenants: Mapping[int, str],
            quota_of: Callable[[str], int]) -> set[bytes]:
    """The index keys to keep among `records` (index key, namespace id, footprint), walked in offset order
    (oldest first). `usage` is updated in place as records are dropped."""
    keep: set[bytes] = set()
    for ikey, ns, fp in records:
        t = tenants.get(ns, "")
        n = usage.get(t, 0)
        if n - fp < quota_of(t):
            keep.add(ikey)
        else:
            usage[t] = n - fp
    return keep
