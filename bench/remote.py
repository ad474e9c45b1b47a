"""The peer tier against the limit measured in the same run: loopback sockets between two processes, and
Mooncake Store's remote get over its TCP transport when its venv is there.

    raw socket   the limit (bench/remote_limit.py): a child process sends 32 x 2 MiB over one loopback
                 connection, this process receives them into a buffer of the arena's kind (a memfd mapping);
                 two ways (kernel defaults, and the TCP plane's socket buffers), the faster median is the limit
    remote get   two daemons joined through a real etcd; 32 blocks of 2 MiB live on the source node (their
                 owner); one leased prefix Lookup (a load) on the other node misses locally and fetches them, in
                 one batched call, into its own arena (reserve -> recv_into the slots -> xxh3 -> commit); the
                 blocks are deleted there again between iterations (untimed) -- over TCP, and over UCX when
                 ucxx is there
    mooncake get Mooncake Store 0.3.13.post1 (bench/mooncake/): a master and two store processes in a network
                 namespace of their own; the holder's segment holds the 32 blocks, the getter's batch_get_into
                 reads them over the TCP transport into a registered buffer of the arena's kind, timed inside
                 the getter (no pipe to this process in the figure). Without the venv the row is left out and
                 the table says how to make it (make setup-mooncake)
    scheduler lookup  the same 32 blocks, asked by a Lookup WITHOUT lease (what vLLM's scheduler sends): one
                 metadata-only probe, the answer, and the fetch left running in the background (its landing is
                 awaited untimed). Its time is what a scheduler step waits; compare it with remote get
    remote put   put_many of 32 x 2 MiB on one node, until its background push to their owner has landed

Warm-up, then round-robin iterations and medians (bench/_common.py): the raw sockets, the product and Mooncake
take turns, so a burst of foreign load lands on all of them alike; ratios measured in the same run are the
numbers to read. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from bench._common import Case, Samples, emit_json, gbs, interleave, print_table
from bench.mooncake.rig import DEFAULT_VENV, SETUP_HINT, MooncakeRig, missing
from bench.remote_limit import VARIANTS, RawSocket
from bench.targets import Target, evaluate, mark
from kvstore.peer.placement import rank
from kvstore.testing import DaemonProcess, EtcdProcess, etcd_binary, peer_options, wait_until

MIB = 1 << 20
BLOCK, BATCH = 2 * MIB, 32
NS = "bench@remote/t"


def _owned_keys(owner: str, members: list[str], n: int, tag: str) -> list[bytes]:
    keys: list[bytes] = []
    i = 0
    while len(keys) < n:
        k = f"{tag}-{i}".encode()
        if rank(NS, k, members)[0] == owner:
            keys.append(k)
        i += 1
    return keys


class Pair:
    """Two daemons (src owns the blocks, dst reads / writes them) in one etcd cluster, on one data plane."""

    def __init__(self, stack: ExitStack, etcd: EtcdProcess, plane: str, replication: str, prefix: str) -> None:
        def opts() -> dict[str, Any]:  # each call: a fresh data port
            return peer_options(etcd, plane=plane, ttl_s=5.0, timeout_s=10.0, replication=replication, prefix=prefix)

        self.src = stack.enter_context(DaemonProcess(arena_bytes="512MiB", **opts()))
        self.dst = stack.enter_context(DaemonProcess(arena_bytes="512MiB", **opts()))
        self.cs = stack.enter_context(self.src.client())
        self.cd = stack.enter_context(self.dst.client())
        for c in (self.cs, self.cd):
            c.register_namespace(NS, model="m", layout_digest="d", tenant="t")
            wait_until(lambda c=c: len(c.health().peers.members) == 2, 15, what="both members")
        self.members = [self.src.node_id, self.dst.node_id]


def _product_cases(stack: ExitStack, etcd: EtcdProcess, planes: list[str],
                   values: list[np.ndarray]) -> tuple[dict[str, Case], Callable[[], None]]:
    """kvstore's cases (remote get per plane, the scheduler's lookup, remote put) and the put's check (run once
    after the timed rounds: the blocks landed on their owner, exactly)."""
    cases: dict[str, Case] = {}
    pairs = {p: Pair(stack, etcd, p, "off", f"/bench-{p}/") for p in planes}
    for plane, pair in pairs.items():
        keys = _owned_keys(pair.src.node_id, pair.members, BATCH, f"get-{plane}")
        pair.cs.put_many(NS, keys, values)

        def fetch(_: object, pair: Pair = pair, keys: list[bytes] = keys) -> None:
            lease = pair.cd.lookup(NS, keys, prefix=True)
            assert lease.num_prefix == BATCH
            pair.cd.release([lease])

        def forget(_: object, p: Pair = pair, k: list[bytes] = keys) -> object:
            return p.cd.delete(NS, k)
        cases[f"remote get {plane}"] = Case(fetch, teardown=forget)
        if plane == "tcp":
            def probe(_: object, pair: Pair = pair, keys: list[bytes] = keys) -> None:
                assert pair.cd.lookup_prefix(NS, keys) == BATCH

            def landed(_: object, pair: Pair = pair, keys: list[bytes] = keys) -> None:
                deadline = time.monotonic() + 30
                while pair.cd.lookup(NS, keys, lease=False).tiers != [1] * BATCH:  # 1 = RAM: prefetched
                    if time.monotonic() > deadline:
                        raise RuntimeError("the prefetch did not land within 30 s")
                    time.sleep(0.001)
                pair.cd.delete(NS, keys)

            cases["scheduler lookup tcp"] = Case(probe, teardown=landed)
    put_pair = Pair(stack, etcd, "tcp", "owner", "/bench-put/")
    put_keys = _owned_keys(put_pair.src.node_id, put_pair.members, BATCH, "put")

    def put(_: object) -> None:
        put_pair.cd.put_many(NS, put_keys, values)
        while put_pair.cd.stats().peers.pending_pushes:  # type: ignore[union-attr]  # the daemons run the peer tier
            time.sleep(0.0005)

    def unput(_: object) -> None:
        put_pair.cd.delete(NS, put_keys)
        put_pair.cs.delete(NS, put_keys)

    def check_put() -> None:
        put(None)
        assert put_pair.cs.exists(NS, put_keys) == [True] * BATCH
        got = put_pair.cs.get_many(NS, put_keys[:2])
        assert [bytes(g) for g in got] == [v.tobytes() for v in values[:2]]  # type: ignore[arg-type]  # a miss fails here
        unput(None)

    cases["remote put tcp"] = Case(put, teardown=unput)
    return cases, check_put


def _figures(res: dict[str, Samples], total: int, limit: float, variant: str, mooncake: str) -> dict[str, Any]:
    """The JSON's figures: GB/s from medians, ratios of medians measured in the same run."""
    def g(name: str) -> float:
        return gbs(total, res[name].p50)
    out: dict[str, Any] = {"raw_socket_gbs": round(limit, 3), "limit_variant": variant,
                           "raw_socket_gbs_by_variant": {v: round(g(f"raw socket {v}"), 3) for v in VARIANTS}}
    out["remote_get_gbs"] = round(g("remote get tcp"), 3)
    out["remote_get_ratio"] = round(g("remote get tcp") / limit, 3)
    out["remote_get_ms"] = round(res["remote get tcp"].p50 * 1e3, 3)
    out["mooncake"] = mooncake
    moon = "mooncake get tcp" in res
    out["mooncake_get_gbs"] = round(g("mooncake get tcp"), 3) if moon else None
    out["mooncake_ratio"] = round(g("mooncake get tcp") / limit, 3) if moon else None
    out["remote_get_over_mooncake"] = round(g("remote get tcp") / g("mooncake get tcp"), 3) if moon else None
    out["remote_put_gbs"] = round(g("remote put tcp"), 3)
    out["ucx_get_gbs"] = round(g("remote get ucx"), 3) if "remote get ucx" in res else None
    out["scheduler_lookup_ms"] = round(res["scheduler lookup tcp"].p50 * 1e3, 3)
    out["scheduler_wait_share"] = round(res["scheduler lookup tcp"].p50 / res["remote get tcp"].p50, 3)
    out["rounds"] = len(res["remote get tcp"])
    return out


def _table(res: dict[str, Samples], total: int, limit: float, variant: str, out: dict[str, Any]) -> None:
    rows: list[list[object]] = []
    for name, s in res.items():
        g = gbs(total, s.p50)
        moved = not name.startswith("scheduler")   # a probe moves no block bytes: no GB/s, no ratio
        label = name + (" (the limit)" if name == f"raw socket {variant}" else "")
        target = mark(TARGETS, out, "remote_get_ratio") if name == "remote get tcp" else ""
        rows.append([label, f"{s.p50 * 1e3:.1f}", f"{s.p90 * 1e3:.1f}", f"{g:.2f}" if moved else "-",
                     f"{g / limit:.2f}" if moved else "-", target])
    if out["remote_get_over_mooncake"] is not None:
        rows.append(["remote get tcp / mooncake get tcp", "", "", "", f"{out['remote_get_over_mooncake']:.2f}",
                     mark(TARGETS, out, "remote_get_over_mooncake")])
    else:
        rows.append([f"mooncake get: {out['mooncake']}", "", "", "", "", ""])
    print_table("kvstore peer tier: 32 x 2 MiB per operation (ms p50 / p90; GB/s from p50; ratio over the limit)",
                ["case", "p50 ms", "p90 ms", "GB/s", "ratio", "target"], rows)


ISSUE = "issue 38 (remote get at the wire's limit)"
TARGETS = (Target("remote_get_ratio", ">=", 0.9, ISSUE), Target("remote_get_over_mooncake", ">=", 1.0, ISSUE))


def _mooncake(stack: ExitStack, venv: Path | None) -> tuple[MooncakeRig | None, str]:
    """The Mooncake rig, or None and why not (the table prints it)."""
    why = missing(venv or DEFAULT_VENV)
    if why is not None:
        return None, why
    try:
        rig = MooncakeRig(venv or DEFAULT_VENV, BLOCK, BATCH)
    except (subprocess.CalledProcessError, RuntimeError) as exc:  # e.g. no CAP_SYS_ADMIN for `ip netns add`
        detail = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) and exc.stderr else exc
        return None, f"could not start: {detail}"
    stack.callback(rig.close)
    return rig, "mooncake-transfer-engine 0.3.13.post1, TCP transport, in a network namespace"


def _check_mooncake(rig: MooncakeRig) -> None:
    """Once, untimed: a get moves every byte over the namespace's loopback and lands the holder's blocks."""
    before = rig.loopback_bytes()
    rig.get()
    moved = rig.loopback_bytes() - before
    if moved < BLOCK * BATCH:
        raise RuntimeError(f"Mooncake's get moved {moved} bytes over loopback, less than the {BLOCK * BATCH} it read")
    if rig.digests() != rig.expected:
        raise RuntimeError("Mooncake's get landed other bytes than the holder put")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.remote", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations (about a minute)")
    ap.add_argument("--json-out", help="also write the JSON line to this file")
    ap.add_argument("--mooncake-venv", type=Path, help=f"the Mooncake venv (default {DEFAULT_VENV}; {SETUP_HINT})")
    ap.add_argument("--no-mooncake", action="store_true", help="leave the Mooncake comparison out")
    args = ap.parse_args(argv)
    if etcd_binary() is None:
        raise SystemExit("bench.remote needs etcd: apt-get install -y etcd-server")
    budget = 0.5 if args.quick else 2.0
    total = BLOCK * BATCH
    rnd = np.random.default_rng(0)
    values = [rnd.integers(0, 255, BLOCK, dtype=np.uint8) for _ in range(BATCH)]
    try:
        import ucxx  # noqa: F401
        planes = ["tcp", "ucx"]
    except Exception:
        planes = ["tcp"]
    out: dict[str, Any] = {"block_bytes": BLOCK, "batch": BATCH}
    with ExitStack() as stack:
        etcd = stack.enter_context(EtcdProcess())
        cases: dict[str, Case] = {}
        for variant in VARIANTS:
            raw = RawSocket(total, BLOCK, variant)
            stack.callback(raw.close)
            cases[f"raw socket {variant}"] = Case(raw.get)
        rig, mooncake_note = (None, "left out (--no-mooncake)") if args.no_mooncake else _mooncake(stack, args.mooncake_venv)
        if rig is not None:
            _check_mooncake(rig)
            cases["mooncake get tcp"] = Case(rig.get)
        product, check_put = _product_cases(stack, etcd, planes, values)
        cases.update(product)
        res = interleave(cases, warmup=2, min_iters=5 if args.quick else 10, budget_s=budget)
        check_put()
        if rig is not None:
            _check_mooncake(rig)   # and after the timed rounds: still the holder's bytes
    variant = min(VARIANTS, key=lambda v: res[f"raw socket {v}"].p50)
    limit = gbs(total, res[f"raw socket {variant}"].p50)
    out.update(_figures(res, total, limit, variant, mooncake_note))
    out["targets"] = evaluate([t for t in TARGETS if t.field in out and out[t.field] is not None], out)
    _table(res, total, limit, variant, out)
    emit_json(out, args.json_out)
    return out


if __name__ == "__main__":
    main()
