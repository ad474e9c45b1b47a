"""The peer data plane over mutual TLS: blocks cross between two daemons; a plaintext or uncertified dialer is
refused at the handshake (counted) and the node keeps serving."""

from __future__ import annotations

import socket
import ssl
from contextlib import ExitStack

import pytest

from kvstore.peer import frames as fr
from kvstore.testing import wait_until
from tests.peer_helpers import Cluster, needs_etcd
from tests.tls_helpers import make_pki

pytestmark = needs_etcd


def test_blocks_cross_the_tls_data_plane_and_strangers_are_refused(tmp_path) -> None:
    pki = make_pki(str(tmp_path / "pki"))
    tls = {"tls_cert": pki.server.cert, "tls_key": pki.server.key, "tls_ca": pki.ca}
    with ExitStack() as stack:
        cluster = Cluster(stack, names=("a", "b"), **tls)
        ns = "tls-peers/ns"
        for c in cluster.clients.values():
            c.register_namespace(ns)
        keys = [b"t%d" % i for i in range(40)]
        on_b = [k for k in keys if cluster.owner(ns, k) == "b"][:5]
        values = [bytes([i + 1]) * (60_000 + i) for i in range(len(on_b))]
        cluster.clients["a"].put_many(ns, on_b, values)
        cluster.wait_pushes("a")
        assert cluster.counters("b")["received_pushes"] >= len(on_b)
        assert cluster.clients["b"].get_many(ns, on_b) == values  # pushed over TLS, now local on b
        on_a = [k for k in keys if cluster.owner(ns, k) == "a"][:3]
        vals_a = [bytes([9]) * 70_000 for _ in on_a]
        cluster.clients["b"].put_many(ns, on_a, vals_a)
        cluster.wait_pushes("b")
        cluster.clients["b"].delete(ns, on_a)  # b forgets them: a read on b must fetch from a over TLS
        assert cluster.clients["b"].get_many(ns, on_a) == vals_a
        assert cluster.counters("b")["fetched_blocks"] >= len(on_a)

        host, _, port = cluster.clients["b"].health().peers.data_address.rpartition(":")
        before = cluster.counters("b")["tls_handshake_failures"]
        with socket.create_connection((host, int(port)), timeout=5) as s:  # plaintext frame on a TLS port
            s.sendall(fr.Header(fr.FETCH, 1, 1, 0, 0).pack())
            try:
                assert s.recv(100) == b""  # closed (or reset) without a frame in answer
            except ConnectionResetError:
                pass
        ctx = ssl.create_default_context(cafile=pki.ca)  # valid server check, but no client certificate
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
                with ctx.wrap_socket(raw, server_hostname=host) as s:
                    s.sendall(fr.Header(fr.FETCH, 1, 1, 0, 0).pack())
                    if not s.recv(100):
                        raise ConnectionError("closed")
        wait_until(lambda: cluster.counters("b")["tls_handshake_failures"] - before >= 2, 10,
                   what="two refused handshakes on b")
        assert all(d.proc.poll() is None for d in cluster.nodes.values())
        assert cluster.clients["a"].get_many(ns, on_b) == values
