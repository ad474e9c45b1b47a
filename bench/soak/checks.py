"""End-of-soak checks: nothing wrong was ever served, no slot leaked, and the disk tier agrees with its index.

    drain(d)          leases and reservations of killed clients expire (TTL) -> 0 active, 0 reserved/leased bytes
    verify_live(d)    every block the daemon lists in the soak namespaces reads back as exactly expected(key)
    tenant_disk(d, t) (disk bytes, disk quota) of tenant t once the write-behind is idle; the soak compares it
                      before and after a last burst of the quota-less fill tenant (the floor must hold)
    offline_disk(...) the stopped daemon's disk tier opened offline: recovery drops no index entry (index and
                      segment files agree) and every record reads back, checksum-verified, as expected(key)
    leaked_slots(d)   clear every namespace; every arena slot must come back (used slots of every size class = 0)
"""

from __future__ import annotations

import ctypes
import mmap
import time
from dataclasses import dataclass

from bench.soak.values import FILL_NS, NS, is_soak_key, wrong_bytes
from kvstore import Client, KVStoreError, UnknownNamespaceError
from kvstore.client.types import Stats
from kvstore.testing import DaemonProcess
from kvstore.tiers.disk import BlockIO, DiskConfig, DiskStore
from kvstore.tiers.disk.types import DiskStatus

__all__ = ["Verified", "drain", "verify_live", "offline_disk", "leaked_slots", "tenant_disk"]

PAGE = 4096


@dataclass
class Verified:
    blocks: int = 0
    bytes: int = 0
    wrong_bytes: int = 0
    on_disk: int = 0
    misses: int = 0

    def add(self, other: Verified) -> None:
        for f in ("blocks", "bytes", "wrong_bytes", "on_disk", "misses"):
            setattr(self, f, getattr(self, f) + getattr(other, f))


def _client(d: DaemonProcess) -> Client:
    return Client(d.address, timeout_s=10, token_file="")


def drain(d: DaemonProcess, timeout_s: float = 30.0) -> Stats:
    """Wait until no lease or reservation is left (killed clients' ones expire by TTL)."""
    deadline = time.monotonic() + timeout_s
    with _client(d) as c:
        while True:
            s = c.stats()
            if (s.leases_active, s.reservations_active, s.reserved_bytes, s.leased_bytes) == (0, 0, 0, 0):
                return s
            if time.monotonic() > deadline:
                return s
            time.sleep(0.1)


def verify_live(d: DaemonProcess) -> Verified:
    out = Verified()
    with _client(d) as c:
        for ns in (NS, FILL_NS):
            try:
                listed = [k for k in c.keys(ns) if is_soak_key(k.key)]
            except UnknownNamespaceError:
                continue
            out.on_disk += sum(1 for k in listed if "disk" in k.tier)
            keys = [k.key for k in listed]
            for i in range(0, len(keys), 64):
                part = keys[i:i + 64]
                for k, v in zip(part, c.get_many(ns, part)):
                    if v is None:
                        out.misses += 1  # evicted / reclaimed between the listing and the read: a miss is fine
                        continue
                    out.blocks += 1
                    out.bytes += len(v)
                    out.wrong_bytes += wrong_bytes(k, v)
    return out


def tenant_disk(d: DaemonProcess, tenant: str, timeout_s: float = 30.0) -> tuple[int, int]:
    deadline = time.monotonic() + timeout_s
    with _client(d) as c:
        while True:
            s = c.stats()
            if s.disk is None or s.disk.write_queue_blocks == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        row = next((t for t in s.tenants if t.tenant == tenant), None)
    return (row.disk_bytes, row.disk_quota_bytes) if row is not None else (0, 0)


def offline_disk(directory: str, capacity_bytes: int, segment_bytes: int) -> dict[str, int]:
    """Open a stopped daemon's disk tier in this process and read every record back."""
    store = DiskStore(DiskConfig(directory=directory, capacity_bytes=capacity_bytes, segment_bytes=segment_bytes),
                      io=BlockIO())
    report = store.open()
    res = {"dropped_entries": report.dropped_entries, "removed_files": report.removed_files, "blocks": 0,
           "bytes": 0, "wrong_bytes": 0, "read_failures": 0}
    buf = mmap.mmap(-1, 4 << 20)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    try:
        for ns in store.namespaces():
            cursor = b""
            while True:
                records, cursor = store.list_keys(ns, cursor, 1000)
                for r in records:
                    status, n = store.read_into(ns, r.key, addr, len(buf))
                    if status != DiskStatus.OK:
                        res["read_failures"] += 1
                        continue
                    if ns in (NS, FILL_NS) and is_soak_key(r.key):
                        res["blocks"] += 1
                        res["bytes"] += n
                        res["wrong_bytes"] += wrong_bytes(r.key, buf[:n])
                if not cursor:
                    break
    finally:
        store.close()
        del addr
        try:
            buf.close()
        except BufferError:
            pass  # a ctypes view still points at it; the process exit frees it
    return res


def leaked_slots(d: DaemonProcess, timeout_s: float = 15.0) -> tuple[int, Stats]:
    """Clear every namespace, then count arena slots still in use (0 = nothing leaked)."""
    with _client(d) as c:
        for n in c.stats().namespaces:
            try:
                c.clear(n.name)
            except KVStoreError:
                pass
        deadline = time.monotonic() + timeout_s
        while True:
            s = c.stats()
            used = sum(sc.used_slots for sc in s.size_classes) + s.leases_active + s.reservations_active
            if used == 0 or time.monotonic() > deadline:
                return used, s
            time.sleep(0.1)
