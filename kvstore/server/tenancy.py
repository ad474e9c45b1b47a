"""Tenant isolation in the daemon: a namespace belongs to the tenant that registered it, and a tenant's token
reaches only its own namespaces, keys, reservations and leases.

Answers for what belongs to someone else are the answers for what does not exist (NOT_FOUND with the same
message: `unknown namespace`, `unknown reservation`; a foreign lease id is not released), so a token cannot
probe another tenant's namespace names, keys or ids. The one exception is RegisterNamespace on a name another
tenant holds: it is refused with PERMISSION_DENIED ("taken"), because one flat name space cannot both refuse
the name and hide that it exists; give tenants name prefixes (`model@digest/<tenant>`) to make it moot.
Stats lists only the caller's namespaces (arena totals stay node-wide); Subscribe delivers only events of the
caller's namespaces.

Owners of namespaces that live on in the disk tier are kept in `<disk_dir>.owners.json` (written atomically at
each first registration), so after a restart a recovered namespace can be claimed only by its old tenant.

Without tokens (current_tenant() is None) every check passes: today's single-tenant behaviour.
"""

from __future__ import annotations

import json
import logging
import os
import threading

from kvstore.engine.engine import Engine
from kvstore.errors import PermissionDeniedError, UnknownNamespaceError, UnknownReservationError
from kvstore.server.auth import current_tenant
from kvstore.validation import check_namespace_name

__all__ = ["TenantGuard"]

log = logging.getLogger(__name__)


class TenantGuard:
    def __init__(self, engine: Engine, owners_path: str = "") -> None:
        self._engine = engine
        self._path = owners_path
        self._lock = threading.Lock()
        self._owners: dict[str, str] = self._load()

    def _load(self) -> dict[str, str]:
        if not self._path or not os.path.exists(self._path):
            return {}
        try:
            with open(self._path, encoding="utf-8") as fh:
                data = json.load(fh)  # JSON only: no pickle anywhere on disk or wire
            return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
        except (OSError, ValueError) as exc:
            log.warning("cannot read namespace owners %s (%s): recovered namespaces stay unclaimed until their "
                        "tenant registers them", self._path, exc)
            return {}

    def _save(self) -> None:
        if not self._path:
            return
        tmp = self._path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(self._owners, fh)
        os.replace(tmp, self._path)

    def known_owners(self) -> dict[str, str]:
        """namespace -> tenant from the owners file (for namespaces recovered from the disk tier)."""
        with self._lock:
            return dict(self._owners)

    @staticmethod
    def caller() -> str | None:
        return current_tenant.get()

    def _owner(self, name: str) -> str | None:
        found = self._engine.namespace_owner(name)
        if found is None:
            return None
        tenant, recovered = found
        if recovered:
            with self._lock:
                return self._owners.get(name, "")
        return tenant

    def owner_of(self, name: str) -> str:
        """The tenant a namespace belongs to ('' when none or unknown): quotas and per-tenant stats use it."""
        return self._owner(name) or ""

    def owns(self, name: str) -> bool:
        caller = self.caller()
        return caller is None or self._owner(name) == caller

    def namespace(self, name: str) -> None:
        """The caller may use namespace `name`; else the same NOT_FOUND an unknown namespace gets."""
        caller = self.caller()
        if caller is None:
            return
        check_namespace_name(name)
        if self._owner(name) != caller:
            raise UnknownNamespaceError(f"unknown namespace {name!r}: register it first (RegisterNamespace)")

    def register(self, name: str, tenant: str) -> str:
        """The tenant to register `name` under: the caller's (a token cannot register for another tenant)."""
        caller = self.caller()
        if caller is None:
            return tenant
        check_namespace_name(name)
        if tenant and tenant != caller:
            raise PermissionDeniedError(f"this token belongs to tenant {caller!r}, not {tenant!r}: leave tenant "
                                        "empty or give your own")
        owner = self._owner(name)
        if owner not in (None, caller) and not (owner == "" and name not in self._owners):
            raise PermissionDeniedError(f"namespace name {name!r} is taken by another tenant: choose another name "
                                        "(e.g. suffix it with your tenant)")
        return caller

    def registered(self, name: str, tenant: str) -> None:
        """Remember the owner of a namespace whose blocks may outlive this process (disk tier): isolation and
        disk quotas apply to it again after a restart, before its tenant registers it anew."""
        if not self._path or not tenant:
            return
        with self._lock:
            if self._owners.get(name) != tenant:
                self._owners[name] = tenant
                self._save()

    def reservation(self, reservation_id: int) -> None:
        caller = self.caller()
        if caller is None:
            return
        ns = self._engine.reservation_namespace(reservation_id)
        if ns is not None and not self.owns(ns):
            raise UnknownReservationError(f"reservation {reservation_id} is unknown to this daemon (never issued, or "
                                          "issued before a restart)")

    def own_leases(self, lease_ids: list[int]) -> list[int]:
        if self.caller() is None:
            return lease_ids
        out = []
        for lid in lease_ids:
            ns = self._engine.lease_namespace(lid)
            if ns is None or self.owns(ns):
                out.append(lid)
        return out
