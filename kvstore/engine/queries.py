"""EngineQueries: the engine's read-only questions (a base class of Engine, engine.py, which owns the parts they
read): ListKeys, Describe and Stats (views.py: the RAM half under the engine's lock, the disk half after it), the
disk tier's state for Health and the metrics, and the ownership questions the service's tenant checks ask
(kvstore/server/tenancy.py). Nothing here changes the store.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.engine.config import EngineConfig
from kvstore.engine.disk_link import DiskLink
from kvstore.engine.engine_lock import EngineLock
from kvstore.engine.leases import LeaseTable
from kvstore.engine.namespaces import NamespaceTable
from kvstore.engine.ram_space import RamSpace
from kvstore.engine.reservations import ReservationTable
from kvstore.engine.results import DiskWriting, EngineStats, KeyRecord
from kvstore.engine.views import Views
from kvstore.errors import InvalidRequestError
from kvstore.validation import check_keys

__all__ = ["EngineQueries"]


class EngineQueries:
    """Read-only questions; the parts are Engine's (set in its __init__)."""

    config: EngineConfig
    _lock: EngineLock
    _names: NamespaceTable
    _views: Views
    _disk: DiskLink
    _ram: RamSpace
    _reservations: ReservationTable
    _leases: LeaseTable

    def _check_keys(self, keys: Sequence[bytes], unique: bool = False) -> None:
        check_keys(keys, self.config.max_batch_keys, max_key_bytes=self.config.max_key_bytes, unique=unique)

    # -- read-only views (views.py): the RAM half under the lock, the disk half after it ------------------
    def list_keys(self, ns_name: str, cursor: bytes, limit: int) -> tuple[list[KeyRecord], bytes]:
        """One page of keys after `cursor` across tiers, in byte order, and the next cursor (b"" at the end)."""
        if not 1 <= limit <= 10000:
            raise InvalidRequestError(f"limit {limit} out of range: use 1..10000")
        with self._lock:
            ns = self._names.get(ns_name)
            records, ram_more = self._views.ram_page(ns, cursor, limit)
        return self._views.page(ns.name, records, ram_more, cursor, limit)

    def held_keys(self, ns_name: str) -> list[bytes]:
        """Every key this node holds in the namespace, committed in RAM or on disk, each once, unordered: what the
        peer tier walks after a membership change to hand blocks to their new owners. O(keys): the RAM half
        under the lock, the disk half after it (a key evicted or written between the two is simply missed or
        listed: the hand-off asks the target first and reads under a lease, so a stale name costs a miss)."""
        with self._lock:
            keys = self._views.ram_keys(self._names.get(ns_name))
        store = self._disk.store
        if store is None:
            return keys
        seen = set(keys)
        cursor = b""
        while True:
            page, cursor = store.list_keys(ns_name, cursor, 10000)
            keys.extend(r.key for r in page if r.key not in seen)
            if not cursor:
                return keys

    def tier_keys(self, ns_name: str) -> tuple[list[bytes], list[bytes]]:
        """(keys committed in RAM, keys on disk) of a namespace, unordered; a key in both is in both lists. The
        vLLM-format event publisher's snapshot after it lost events (kvstore/server/kv_events): O(keys), the RAM
        half under the lock, the disk half after it (a block that moves in between is set right by the events
        that follow, which the publisher applies after the snapshot)."""
        with self._lock:
            ram = self._views.ram_keys(self._names.get(ns_name))
        store = self._disk.store
        disk: list[bytes] = []
        cursor = b""
        while store is not None:
            page, cursor = store.list_keys(ns_name, cursor, 10000)
            disk.extend(r.key for r in page)
            if not cursor:
                break
        return ram, disk

    def namespace_labels(self, ns_name: str) -> tuple[str, str]:
        """(model, tenant) a namespace was registered with ('' each when recovered from disk and not registered
        since); UnknownNamespaceError if it is not known."""
        with self._lock:
            ns = self._names.get(ns_name)
            return ns.model, ns.tenant

    def describe(self, ns_name: str, keys: Sequence[bytes]) -> list[KeyRecord]:
        """Records of the present keys among `keys` (any tier), in request order."""
        self._check_keys(keys)
        with self._lock:
            ram = self._views.ram_records(self._names.get(ns_name), keys)
        return self._views.describe(ns_name, keys, ram)

    def stats(self) -> EngineStats:
        with self._lock:
            st = self._views.ram_stats()
        return self._views.with_disk(st)

    @property
    def disk_enabled(self) -> bool:
        return self._disk.store is not None

    @property
    def disk_directory(self) -> str:
        return self._disk.store.config.directory if self._disk.store is not None else ""

    @property
    def write_queue_blocks(self) -> int:
        return self._disk.queued_writes

    @property
    def admission_name(self) -> str:
        return self._disk.admission.name

    def disk_writing(self) -> DiskWriting:
        """When the disk tier is written and at what rate: the mode, what is in flight, the budget's state."""
        with self._lock:
            budget = self._disk.budget
            return DiskWriting(self._disk.write_mode, len(self._disk.promotions), self._disk.writebacks,
                               budget.state() if budget is not None else None)

    def disk_degraded_reason(self) -> str:
        """Why the disk tier is degraded ('' when healthy or absent): Health reports it."""
        store = self._disk.store
        if store is None or not store.degraded:
            return ""
        return store.stats().degraded_reason or "disk tier degraded"

    # -- tenants: the ownership questions the service's tenant checks ask (kvstore/server/tenancy.py) ----
    def tenant_usage(self) -> dict[str, int]:
        """RAM payload bytes per tenant (what quotas compare against)."""
        with self._lock:
            return self._ram.tenant_usage()

    def namespace_owner(self, name: str) -> tuple[str, bool] | None:
        """(tenant, recovered) of a namespace, None if unknown; recovered: known from the disk tier only."""
        with self._lock:
            return self._names.owner(name)

    def reservation_namespace(self, reservation_id: int) -> str | None:
        with self._lock:
            return self._reservations.namespace_of(reservation_id)

    def lease_namespace(self, lease_id: int) -> str | None:
        with self._lock:
            return self._leases.namespace_of(lease_id)
