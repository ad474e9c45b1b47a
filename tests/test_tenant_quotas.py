"""Per-tenant RAM quotas with exact byte counts: one tenant's burst cannot evict another below its quota.

Arena of 8 slots of 1 MiB (8 MiB arena, 1 MiB blocks, watermarks at 1.0 so only allocations evict). Usage is
the committed payload bytes of a tenant's namespaces in RAM (engine/quotas.py). The client holds no spare slots
(spare_slots=False): one would take a ninth of this tiny arena and shift every count.
"""

from __future__ import annotations

import pytest

from kvstore import StoreFullError
from kvstore.engine.quotas import TenantQuotas
from kvstore.testing import DaemonProcess

MIB = 1 << 20


def _usage(c) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in c.stats().namespaces:
        if n.bytes:
            out[n.tenant] = out.get(n.tenant, 0) + n.bytes
    return out


def _put(c, ns: str, first: int, n: int) -> None:
    for i in range(first, first + n):
        c.put(ns, b"k%d" % i, bytes([i % 251]) * MIB)


def _opts(quota: str) -> dict[str, object]:
    return dict(arena_bytes="8MiB", max_block_bytes="1MiB", high_watermark=1.0, low_watermark=1.0,
                tenant_ram_quota=quota)


def test_quotas_are_floors_that_other_bursts_cannot_break() -> None:
    with DaemonProcess(**_opts("a=4MiB,b=4MiB")) as d, d.client(spare_slots=False) as c:
        for t in ("a", "b", "c"):
            c.register_namespace(f"q/{t}", tenant=t)
        _put(c, "q/a", 0, 4)                       # a: 4 MiB (at its quota)
        _put(c, "q/b", 0, 4)                       # b: 4 MiB, arena full (8 slots)
        assert _usage(c) == {"a": 4 * MIB, "b": 4 * MIB}
        _put(c, "q/b", 4, 4)                       # b's burst of 4 more evicts b's own oldest, never a's
        assert _usage(c) == {"a": 4 * MIB, "b": 4 * MIB}
        assert c.exists("q/a", [b"k%d" % i for i in range(4)]) == [True] * 4
        assert c.exists("q/b", [b"k%d" % i for i in range(8)]) == [False] * 4 + [True] * 4
        with pytest.raises(StoreFullError):          # c has no quota and nothing of its own: store full
            c.put("q/c", b"x", b"z" * MIB)
        assert _usage(c) == {"a": 4 * MIB, "b": 4 * MIB}
        assert c.get("q/a", b"k0") == bytes([0]) * MIB


def test_over_quota_tenants_are_evicted_first_down_to_their_quota() -> None:
    with DaemonProcess(**_opts("a=2MiB,b=4MiB")) as d, d.client(spare_slots=False) as c:
        for t in ("a", "b"):
            c.register_namespace(f"q/{t}", tenant=t)
        _put(c, "q/a", 0, 6)                       # a borrows free RAM: 6 MiB, quota 2 MiB
        _put(c, "q/b", 0, 2)                       # arena full
        assert _usage(c) == {"a": 6 * MIB, "b": 2 * MIB}
        _put(c, "q/b", 2, 4)                       # b takes back: evicts a (over quota) oldest first
        assert _usage(c) == {"a": 2 * MIB, "b": 6 * MIB}
        assert c.exists("q/a", [b"k%d" % i for i in range(6)]) == [False] * 4 + [True] * 2
        _put(c, "q/b", 6, 2)                       # a is at its floor now: b (over its quota) evicts itself
        assert _usage(c) == {"a": 2 * MIB, "b": 6 * MIB}
        assert c.exists("q/b", [b"k0", b"k1", b"k6", b"k7"]) == [False, False, True, True]


def test_default_quota_and_no_quotas() -> None:
    q = TenantQuotas({"a": 5, "*": 3})
    assert q.enabled and (q.quota("a"), q.quota("zzz")) == (5, 3)
    assert not TenantQuotas({}).enabled
