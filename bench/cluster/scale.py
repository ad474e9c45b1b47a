"""`python -m bench.cluster.scale`: the peer tier at 16 to 1,024 nodes, on paper and in simulation.

No processes: the real placement and hand-off code (kvstore/peer/placement.py) driven by simulated member sets.
Per cluster size N:
    moved per join     of the keys the N nodes hold (each at its owner), the share a new member takes, and the
                       most any one sender hands over (HRW: about 1 / (N + 1), spread over every member)
    moved per death    the share a dead member's keys are of all (each goes to its next-ranked member)
    fan-out            peers one prefix Lookup of L keys asks (one probe per peer; keys this node owns ask
                       nobody), for L = 64 and 280 (a 142K-token agent prompt at 512 tokens a key)
    watch traffic      etcd's answers per membership change (one event to each watcher) and per second at rest
                       (keepalives), against re-reading the member set every refresh tick (the old polling)
    placement CPU      seconds to rank one 280-key Lookup's keys, and to run a hand-off pass over 100K keys,
                       measured here (one thread)
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import time

from bench._common import emit_json, print_table
from kvstore.peer.membership import Member
from kvstore.peer.placement import handoff_targets_of, owners_of, read_orders

__all__ = ["main"]

_HEADER = {"cluster_id": "14841639068965178418", "member_id": "10276657743932975437", "revision": "123456",
           "raft_term": "7"}  # etcd's answer header, as its JSON gateway writes it (sizes only)


def _kv(n: int) -> dict:
    """One member's record as etcd's JSON gateway answers it (key and value base64, revisions as strings)."""
    m = Member(f"node-{n:04d}", f"10.0.{n // 256}.{n % 256}:7070", f"10.0.{n // 256}.{n % 256}:7071", "tcp", 1 << 40)
    return {"key": base64.b64encode(f"/kvstore/members/{m.node_id}".encode()).decode(),
            "create_revision": "123400", "mod_revision": "123456", "version": "1",
            "value": base64.b64encode(m.encode()).decode(), "lease": "7587869371592391180"}


def _size(obj: object) -> int:
    return len(json.dumps(obj, separators=(",", ":")))


EVENT_BYTES = _size({"result": {"header": _HEADER, "events": [{"kv": _kv(1)}]}}) + 1  # one watch answer line
KEEPALIVE_BYTES = (_size({"ID": "7587869371592391180"})
                   + _size({"result": {"header": _HEADER, "ID": "7587869371592391180", "TTL": "5"}}))


def _ids(n: int) -> list[str]:
    return [f"node-{i:04d}" for i in range(n)]


def _moves(n: int, keys: list[bytes]) -> dict:
    ids = _ids(n)
    owner = [o[0] for o in owners_of("ns", keys, ids, 1)]
    before, joined = frozenset(ids), frozenset(ids + ["node-new"])
    t0 = time.perf_counter()
    per_sender: dict[str, int] = {}
    moved = 0
    for m in ids:  # each member's own keys, as its hand-off pass sees them
        mine = [k for k, o in zip(keys, owner) if o == m]
        for targets in handoff_targets_of("ns", mine, before, joined, 1, m):
            if targets:
                moved += 1
                per_sender[m] = per_sender.get(m, 0) + 1
    pass_s = time.perf_counter() - t0
    dead = ids[0]
    died = sum(o == dead for o in owner)
    return {"join_share": moved / len(keys), "join_max_sender_share": max(per_sender.values(), default=0) / len(keys),
            "death_share": died / len(keys), "handoff_s_per_100k_keys": pass_s * 100_000 / len(keys)}


def _fanout(n: int, length: int, samples: int) -> float:
    ids = frozenset(_ids(n))
    peers = []
    for s in range(samples):
        keys = [b"req%d-%d" % (s, i) for i in range(length)]
        orders = read_orders("ns", keys, ids, [], 1, "node-0000")
        peers.append(len({o[0] for o in orders if o}))
    return statistics.mean(peers)


def _lookup_cpu(n: int) -> float:
    ids = frozenset(_ids(n))
    keys = [b"cpu-%d" % i for i in range(280)]
    read_orders("ns", keys, ids, [], 1, "node-0000")
    times = []
    for _ in range(5):
        t = time.perf_counter()
        read_orders("ns", keys, ids, [], 1, "node-0000")
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _etcd(n: int, refresh_s: float) -> dict:
    """Bytes etcd sends and takes: a watch answer to each of the n watchers per change, n keepalives per tick;
    against the polling this replaced, a range answer of all n records to each of the n nodes per tick."""
    poll = _size({"header": _HEADER, "kvs": [_kv(i) for i in range(n)], "count": str(n)})
    return {"watch_bytes_per_change": n * EVENT_BYTES, "keepalive_bytes_per_s": n * KEEPALIVE_BYTES / refresh_s,
            "poll_bytes_per_s": n * poll / refresh_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="16,64,256,1024")
    p.add_argument("--keys", type=int, default=20_000, help="keys held across the cluster (simulated)")
    p.add_argument("--samples", type=int, default=20, help="prefix Lookups sampled per size")
    p.add_argument("--refresh-s", type=float, default=0.5, help="peer_refresh_s (keepalive; the old poll's tick)")
    a = p.parse_args(argv)
    sizes = [int(x) for x in a.nodes.split(",") if x]
    keys = [b"key-%08d" % i for i in range(a.keys)]
    rows, out = [], {}
    for n in sizes:
        m = _moves(n, keys)
        r = {**m, "fanout_64": _fanout(n, 64, a.samples), "fanout_280": _fanout(n, 280, a.samples),
             "lookup_cpu_ms_280": _lookup_cpu(n) * 1000, **_etcd(n, a.refresh_s)}
        out[str(n)] = {k: round(v, 5) for k, v in r.items()}
        rows.append([n, f"{r['join_share']:.4f}", f"{1 / (n + 1):.4f}", f"{r['join_max_sender_share']:.5f}",
                     f"{r['death_share']:.4f}", f"{r['fanout_64']:.1f}", f"{r['fanout_280']:.1f}",
                     f"{r['lookup_cpu_ms_280']:.2f}", f"{r['handoff_s_per_100k_keys']:.2f}",
                     f"{r['watch_bytes_per_change'] / 1e3:.0f} KB", f"{r['keepalive_bytes_per_s'] / 1e3:.1f} KB/s",
                     f"{r['poll_bytes_per_s'] / 1e6:.1f} MB/s"])
    print_table("the peer tier at scale (simulated member sets; the real placement and hand-off code)",
                ["N", "join moves", "1/(N+1)", "one sender", "death moves", "peers/64 keys", "peers/280 keys",
                 "rank 280 ms", "hand-off s/100K", "etcd/change", "keepalives", "polling"], rows)
    emit_json({"sizes": out, "keys": a.keys, "refresh_s": a.refresh_s})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
