"""The peer tier's small parts on their own: frames, placement, config validation."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import ConfigError
from kvstore.peer import frames as fr
from kvstore.peer.placement import owners, rank
from kvstore.server.config import load_config


def test_frames_round_trip() -> None:
    keys = [b"a", b"bb" * 10, bytes(range(64))]
    ns, got = fr.decode_fetch(fr.encode_fetch("m@d/t", keys), 3)
    assert (ns, got) == ("m@d/t", keys)
    sizes, sums = np.array([5, 0, 7]), np.array([1, 0, 2**64 - 1], dtype=np.uint64)
    s2, c2 = fr.decode_sizes(fr.encode_sizes(sizes, sums), 3, 12, 4096)
    assert s2.tolist() == [5, 0, 7] and c2.tolist() == [1, 0, 2**64 - 1]
    desc = fr.NamespaceDesc("n", "model", "dig", "ten", 16)
    d, k, s, c = fr.decode_push(fr.encode_push(desc, keys, sizes, sums), 3, 12, 4096)
    assert (d, k, s.tolist(), c.tolist()) == (desc, keys, [5, 0, 7], [1, 0, 2**64 - 1])
    h = fr.Header(fr.FETCH, 7, 3, 10, 0)
    assert fr.check_header(h.pack(), max_keys=4, max_block_bytes=4096) == h
    assert fr.decode_presence(fr.encode_presence([True, False, True]), 3) == [True, False, True]
    with pytest.raises(fr.FrameError, match="presence table of 2 bytes for 3 keys"):
        fr.decode_presence(b"\x01\x00", 3)
    with pytest.raises(fr.FrameError, match="other than 0 or 1"):
        fr.decode_presence(b"\x01\x02", 2)


@pytest.mark.parametrize("raw, why", [
    (b"KVSP", "truncated"),
    (b"XXXX" + bytes(28), "magic"),
    (fr.HEADER.pack(fr.MAGIC, 2, fr.FETCH, 0, 1, 1, 0, 0), "version"),
    (fr.HEADER.pack(fr.MAGIC, 1, 9, 0, 1, 1, 0, 0), "op"),
    (fr.HEADER.pack(fr.MAGIC, 1, fr.FETCH, 0, 1, 5, 0, 0), "keys"),
    (fr.HEADER.pack(fr.MAGIC, 1, fr.FETCH, 0, 1, 1, fr.MAX_META_BYTES + 1, 0), "metadata"),
    (fr.HEADER.pack(fr.MAGIC, 1, fr.PUSH, 0, 1, 1, 0, 4097), "payload"),
])
def test_bad_headers_are_rejected(raw: bytes, why: str) -> None:
    with pytest.raises(fr.FrameError, match=why):
        fr.check_header(raw, max_keys=4, max_block_bytes=4096)


def test_bad_metadata_is_rejected() -> None:
    with pytest.raises(fr.FrameError, match="add up"):
        fr.decode_sizes(fr.encode_sizes(np.array([5]), np.array([0], dtype=np.uint64)), 1, 6, 4096)
    with pytest.raises(fr.FrameError, match="max 4096"):
        fr.decode_sizes(fr.encode_sizes(np.array([5000]), np.array([0], dtype=np.uint64)), 1, 5000, 4096)
    with pytest.raises(fr.FrameError, match="shorter"):
        fr.decode_fetch(fr.encode_fetch("ns", [b"abc"])[:-1], 1)
    with pytest.raises(fr.FrameError, match="unexpected bytes"):
        fr.decode_fetch(fr.encode_fetch("ns", [b"abc"]) + b"!", 1)


def test_rendezvous_is_stable_and_moves_only_the_leavers_keys() -> None:
    members = ["n1", "n2", "n3", "n4"]
    keys = [b"k%d" % i for i in range(2000)]
    before = {k: rank("ns", k, members)[0] for k in keys}
    assert before == {k: rank("ns", k, list(reversed(members)))[0] for k in keys}  # order of members is irrelevant
    counts = {m: list(before.values()).count(m) for m in members}
    assert all(400 < n < 600 for n in counts.values()), counts  # roughly even
    after = {k: rank("ns", k, ["n1", "n2", "n4"])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "n3" for k in moved)  # only n3's keys move
    assert owners("ns", b"k1", members, 2)[0] == before[b"k1"] and len(owners("ns", b"k1", members, 2)) == 2
    other_ns = {k: rank("other", k, members)[0] for k in keys}
    assert sum(other_ns[k] != before[k] for k in keys) > 1000  # the namespace is part of the hashed item


@pytest.mark.parametrize("args, message", [
    (["--etcd-endpoints", "localhost:2379"], "not an etcd client URL"),
    (["--etcd-endpoints", "http://127.0.0.1:2379", "--peer-replication", "all"], "peer_replication"),
    (["--etcd-endpoints", "http://127.0.0.1:2379", "--peer-data-plane", "rdma"], "peer_data_plane"),
    (["--etcd-endpoints", "http://127.0.0.1:2379", "--peer-timeout-s", "0"], "peer_timeout_s"),
    (["--etcd-endpoints", "http://127.0.0.1:2379", "--peer-lease-ttl-s", "3", "--peer-refresh-s", "2"], "peer_refresh_s"),
    (["--etcd-endpoints", "http://127.0.0.1:2379", "--peer-listen", "nohost"], "peer_listen"),
    (["--etcd-endpoints", "http://127.0.0.1:2379", "--etcd-prefix", "members"], "etcd_prefix"),
    (["--etcd-endpoints", "http://127.0.0.1:2379", "--node-id", "~n1"], "node_id='~n1': a cluster member's id"),
    (["--etcd-endpoints", "http://127.0.0.1:2379", "--node-id", "\u00e9n1"], "must start with a character below"),
])
def test_peer_config_errors_name_the_setting(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(args, env={})


def test_peer_settings_are_validated_even_without_etcd() -> None:
    with pytest.raises(ConfigError, match="peer_data_plane='rdma': use tcp, ucx or grpc"):
        load_config(["--peer-data-plane", "rdma"], env={})  # a typo surfaces now, not when the node joins
    cfg = load_config(["--listen", ""], env={})             # alone, an empty listen is fine
    assert cfg.peer_endpoints == []
    cfg = load_config([], env={"KVSTORE_ETCD_ENDPOINTS": "http://127.0.0.1:2379, http://localhost:2379"})
    assert cfg.peer_endpoints == ["http://127.0.0.1:2379", "http://localhost:2379"]
