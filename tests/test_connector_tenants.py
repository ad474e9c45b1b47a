"""Two tenants of one model through the connector's link: the daemon names each token's tenant (Health.tenant),
and the connector's namespaces carry it, so both register the same model's layout without a "taken" refusal
and see only their own blocks. Without tokens the names are the ones they always were. (End to end with
two real vLLM processes: tests/vllm_e2e/test_vllm_tenants_e2e.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore_connector.link import StoreLink
from kvstore_connector.namespace import KVLayoutSpec, StageLayouts, namespace_for
from kvstore.client import Client
from kvstore.errors import PermissionDeniedError
from kvstore.testing import DaemonProcess
from tests.tenant_helpers import two_tenant_daemon

SPEC = KVLayoutSpec("org/llama", "float16", 16, 2, 2, 64, 0, 1, 1)


def test_names_carry_the_tenant_and_stay_as_they_were_without_one() -> None:
    base = namespace_for(SPEC)
    assert base == f"vllm/llama/{SPEC.digest()}"
    assert namespace_for(SPEC, None, "alice") == base + "/tenant=alice"
    assert namespace_for(SPEC, "s1", "alice") == namespace_for(SPEC, "s1").replace("/salt=", "/tenant=alice/salt=")
    # the longest: an 80-character model, a 64-character tenant and a salt still make a valid name (<= 200)
    long = namespace_for(KVLayoutSpec("m" * 120, "float16", 16, 2, 2, 64, 0, 1, 1), "salt", "t" * 64)
    assert len(long) == 196
    # the link's registration still finds the layout of a tenant's name
    assert StageLayouts([SPEC]).registration(base + "/tenant=alice")["layout_digest"] == SPEC.digest()


def test_the_daemon_names_each_tokens_tenant_and_their_namespaces_keep_apart(tmp_path: Path) -> None:
    gen = two_tenant_daemon(tmp_path)
    d, alice_file, bob_file = next(gen)
    try:
        links = {t: StoreLink(d.address, timeout_s=5.0, client_factory=lambda f=f: Client(d.address, token_file=f),
                              namespace_spec=StageLayouts([SPEC]).registration)
                 for t, f in (("alice", alice_file), ("bob", bob_file))}
        assert {t: link.tenant for t, link in links.items()} == {"alice": None, "bob": None}  # not connected yet
        assert all(link.connect() for link in links.values())
        assert {t: link.tenant for t, link in links.items()} == {"alice": "alice", "bob": "bob"}
        names = {t: namespace_for(SPEC, None, link.tenant or "") for t, link in links.items()}
        for t, link in links.items():
            assert link.call(names[t], lambda c, t=t: c.put(names[t], b"k0", t.encode() * 64)) is not None
        assert links["alice"].call(names["alice"], lambda c: c.get(names["alice"], b"k0")) == b"alice" * 64
        assert links["bob"].call(names["bob"], lambda c: c.get(names["bob"], b"k0")) == b"bob" * 64
        # the name without the tenant, as before: the second tenant's registration is refused
        with Client(d.address, token_file=alice_file) as alice, Client(d.address, token_file=bob_file) as bob:
            alice.register_namespace(namespace_for(SPEC))
            with pytest.raises(PermissionDeniedError, match="taken by another tenant"):
                bob.register_namespace(namespace_for(SPEC))
            assert [n.name for n in bob.stats().namespaces] == [names["bob"]]
        for link in links.values():
            link.close()
    finally:
        gen.close()
    with DaemonProcess() as plain:
        link = StoreLink(plain.address, timeout_s=5.0)
        assert link.connect() and link.tenant == ""
        link.close()
