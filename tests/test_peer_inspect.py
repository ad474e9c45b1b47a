"""`kvstore inspect` across a cluster: three real daemons and etcd; keys put on other nodes show where they are.

Replication is off, so each block lives exactly where it was put (every placement below is exact).
"""

from __future__ import annotations

import json
from contextlib import ExitStack

import pytest

from kvstore.cli.main import main
from tests.peer_helpers import Cluster, needs_etcd, register

pytestmark = [needs_etcd]
NS = "inspect/cluster"


def test_inspect_names_the_nodes_that_hold_each_key(capsys: pytest.CaptureFixture[str]) -> None:
    with ExitStack() as stack:
        cl = Cluster(stack, replication="off")
        register(cl.clients, NS)
        a, b, c = (cl.clients[n] for n in "abc")
        assert a.put_many(NS, [b"a0", b"a1"], [b"x" * 100, b"y" * 200]).stored == 2
        assert b.put_many(NS, [b"b0"], [b"z" * 300]).stored == 1
        assert c.put_many(NS, [b"c0"], [b"w" * 400]).stored == 1
        assert a.put_many(NS, [b"c0"], [b"w" * 400]).stored == 1  # also on a
        capsys.readouterr()
        rc = main(["--address", cl.nodes["c"].address, "--json", "inspect", NS, "c0", "a0", "b0", "a1", "nope"])
        assert rc == 0
        doc = json.loads(capsys.readouterr().out)
        got = [(k["key_text"], k["tier"], k["size"], k["node"], [(n["node"], n["tier"]) for n in k["nodes"]])
               for k in doc["keys"]]
        ida, idb, idc = cl.ids
        assert got == [("c0", "ram", 400, idc, [(idc, "ram"), (ida, "ram")]),
                       ("a0", "peer", 100, ida, [(ida, "ram")]),
                       ("b0", "peer", 300, idb, [(idb, "ram")]),
                       ("a1", "peer", 200, ida, [(ida, "ram")]),
                       ("nope", "missing", None, None, [])]
        # inspecting asked, it did not fetch: c still holds only c0
        assert [x is not None for x in c.describe(NS, [b"c0", b"a0", b"b0", b"a1"])] == [True, False, False, False]
