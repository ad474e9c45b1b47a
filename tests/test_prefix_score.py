"""A prefix score per node (Client.prefix_score, `kvstore score`, the PrefixScore RPC): for each live member, the
leading blocks of a chain it would serve from its RAM, from its disk and from peers. Exact counts: one node with a
disk tier, a cluster of three (real etcd, real daemons), and the rule itself on values."""

from __future__ import annotations

import json
from contextlib import ExitStack

import pytest

from bench.serve.driver import round_robin
from bench.serve.router import PrefixRouter
from kvstore.cli.keys_input import chain_keys
from kvstore.cli.main import main
from kvstore.errors import BatchTooLargeError, UnknownNamespaceError
from kvstore.peer.scores import NodeShare, shares
from kvstore.testing import wait_until
from tests.peer_helpers import Cluster, needs_etcd

NS = "score/ns"


def test_the_rule_on_values() -> None:
    """Keys 0..4; node a holds 0 (RAM) and 2 (disk); b holds 1 and 3; c did not answer. a's Lookup asks b for
    every key, b asks a; key 4 nobody holds."""
    tiers = {"a": [1, 0, 2, 0, 0], "b": [0, 1, 0, 2, 0], "c": None}
    orders = {"a": [["b"]] * 5, "b": [["a"]] * 5, "c": [["a", "b"]] * 5}
    got = shares(5, tiers, {"a": "h:1"}, "b", lambda n: orders[n])
    assert got == [NodeShare("b", "", True, True, ram_blocks=1, disk_blocks=1, peer_blocks=2),
                   NodeShare("a", "h:1", False, True, ram_blocks=1, disk_blocks=1, peer_blocks=2),
                   NodeShare("c", "", False, False, ram_blocks=0, disk_blocks=0, peer_blocks=4)]
    # a node that would not ask the holder gets nothing from it: the prefix ends there
    assert shares(2, {"a": [0, 1], "b": [1, 0]}, {}, "a", lambda n: [[], []])[0].blocks == 0


def test_one_node_ram_and_disk(make_daemon, tmp_path) -> None:
    d = make_daemon(disk_bytes="16MiB", disk_segment_bytes="2MiB", max_block_bytes="1MiB", disk_dir=str(tmp_path / "disk"),
                    disk_sync="none", disk_write="commit")  # write-behind: k1 is on disk before the demote
    with d.client() as c:
        c.register_namespace(NS, tokens_per_block=4)
        keys = [b"k0", b"k1", b"k2", b"k3"]
        c.put_many(NS, keys[:3], [b"x" * 4096] * 3)
        c.put(NS, b"k3", b"x" * 4096)
        c.delete(NS, [b"k3"])
        c.put(NS, b"k4", b"y")
        wait_until(lambda: c.stats().disk.write_queue_blocks == 0, what="write-behind")
        assert c.hint(NS, [b"k1"], "demote") == ["accepted"]  # k1 on disk only
        (s,) = c.prefix_score(NS, keys + [b"k4"])  # k3 is gone: the prefix ends at it, k4 does not count
        assert (s.node_id, s.is_self, s.answered) == (d.node_id, True, True)
        assert (s.ram_blocks, s.disk_blocks, s.peer_blocks, s.ram_tokens, s.disk_tokens, s.peer_tokens) == \
            (2, 1, 0, 8, 4, 0)
        # metadata only: k1 was not promoted, no lookup was counted
        (ns,) = [n for n in c.stats().namespaces if n.name == NS]
        assert c.describe(NS, [b"k1"])[0].tier == "disk" and ns.lookup_keys == 0
        with pytest.raises(UnknownNamespaceError):
            c.prefix_score("score/unknown", keys)
        with pytest.raises(BatchTooLargeError):
            c.prefix_score(NS, [b"%d" % i for i in range(c.max_batch_keys + 1)])


@needs_etcd
def test_every_member_of_a_cluster_in_one_call(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """Replication owner with local copies kept: a prompt put on a is on a (RAM) and at each key's owner. Every
    node's prefix is the whole chain up to a key nobody holds; its RAM part is what it holds, the rest from peers."""
    tokens = list(range(100, 100 + 4 * 8 + 2))  # 8 full blocks of 4, and 2 tokens past them
    with ExitStack() as stack:
        cl = Cluster(stack, replication="owner", peer_local_copies="keep")
        for client in cl.clients.values():
            client.register_namespace(NS, model="m", tokens_per_block=4)
        keys = chain_keys(tokens, 4, 0)
        a = cl.clients["a"]
        a.put_many(NS, keys[:6] + keys[7:], [b"v" * 1024] * 7)  # block 6 is never stored
        cl.wait_pushes("a")
        owners = [cl.owner(NS, k) for k in keys[:6]]
        want = {"a": (6, 0)}
        for name in "bc":
            own = sum(1 for o in owners if o == name)
            want[name] = (own, 6 - own)
        for asked in "abc":  # any node answers for all of them, itself first
            got = cl.clients[asked].prefix_score(NS, keys)
            assert got[0].node_id == cl.nodes[asked].node_id and got[0].is_self
            by_name = {n: next(s for s in got if s.node_id == cl.nodes[n].node_id) for n in "abc"}
            assert {n: (s.ram_blocks, s.peer_blocks) for n, s in by_name.items()} == want
            assert all(s.answered and s.disk_blocks == 0 and s.tokens == 4 * s.blocks for s in got)
        assert sum(cl.counters(n)["score_calls"] for n in "abc") == 3
        # the CLI: token ids in, the same answer, the best node named
        prompt = tmp_path / "prompt.json"
        prompt.write_text(json.dumps(tokens))
        capsys.readouterr()
        assert main(["--address", cl.nodes["b"].address, "--json", "score", NS, "--tokens-file", str(prompt)]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["blocks"] == 8 and doc["tokens_per_block"] == 4 and doc["best"] == cl.nodes["a"].node_id
        assert {n["node_id"]: (n["ram_tokens"], n["peer_tokens"]) for n in doc["nodes"]} == {
            cl.nodes[n].node_id: (4 * r, 4 * p) for n, (r, p) in want.items()}
        assert main(["--address", cl.nodes["b"].address, "score", NS, "--tokens-file", str(prompt)]) == 0
        out = capsys.readouterr().out
        assert f"best: {cl.nodes['a'].node_id} (6 ram + 0 disk + 0 peer of 8 blocks)" in out
        assert main(["--address", cl.nodes["b"].address, "score", NS]) == 2  # no keys given: a clear error
        assert "give exactly one of KEY_HEX" in capsys.readouterr().err
        # bench.serve's (r) router: to b over a? a holds the whole prefix in its RAM; a prompt nobody holds goes
        # round-robin, as (d) routes it
        router = PrefixRouter([cl.nodes["b"].address, cl.nodes["a"].address], [cl.nodes[n].node_id for n in "ba"],
                              namespace_prefix=NS)
        try:
            assert router(0, 0, 0, tokens) == 1 and router(5, 0, 0, tokens + [7]) == 1
            assert router(0, 0, 1, [9] * 40) == round_robin(0, 0, 1) == 1
            # three calls in flight on a, none on b: the score still says a, the load says b
            assert router(1, 0, 0, tokens) == 0
            for server in (1, 1, 1, 0):
                router.done(server)
            assert router(1, 0, 0, tokens) == 1
            assert router.summary() == {"decided": 3, "balanced": 1, "round_robin": 1}
        finally:
            router.close()
