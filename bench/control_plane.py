"""bench.micro's control-plane section: the fast path and gRPC against a raw unix socket, hot and cold.

What vLLM's scheduler waits for inside a step is a Lookup of the prompt's chain (280 keys for a 142K-token
prompt in 512-token blocks; prefix=True, lease=False: a probe). Its limit is a request/response of the same
bytes between two Python processes over a unix socket (bench/uds_limit.py). The cases:

  uds rtt / uds echo     the raw socket with the Lookup's real encoded frame sizes / with empty frames
  fast / grpc echo       client.echo(b""): ECHO on the fast path (the daemon does nothing), Health on gRPC
  lookup                 client.lookup(280 stored keys, prefix=True, lease=False); every key is in the shared key
                         index, so the client answers from it (hit columns too) and sends the effects one way
                         (HITS: no reply awaited; back to back, the daemon's pace applying them bounds it);
                         lookup daemon: the same with the index off in that client (the daemon finds the keys)
  probe / probe daemon   client.probe_prefix(the same 280 keys): the scheduler's call (counts only); answered
                         from the shared key index as lookup is / with the index turned off in that client
                         ($KVSTORE_KEY_INDEX=0: the daemon looks up every key)
  lookup lease           lease=True, the lease released untimed (wait=True) after each call
  lookup lease+release   lease=True and its Release(wait=True), both timed: the get path's two round trips
  reserve+commit         Reserve of 1 fresh key of 4 KiB and its Commit (no copy: the control plane alone)
  probe x8 / x8 seq      the scheduler's probe of a TP 8 model: the same chain in 8 rank namespaces,
                         Client.probe_prefix_many (pipelined: one round trip) / 8 probe_prefix calls in a row

Two conditions, because on this VM the state of the answering process dominates a round trip: a raw socket
round trip takes ~30 us back to back but ~80 us when the peer sat idle for 1 ms and ~200 us after 20 ms (waking
an idle process and its vCPU; measured with the peer and the caller on one CPU too, so not only an IPI).
- hot: blocks of consecutive calls per case (the first few untimed), the blocks round-robin over the cases.
  The product's own work shows here; the targets are judged on it (the fields without a suffix).
- cold: every call after the caller and the daemon sat idle COLD_GAP_S (a vLLM step under load), round-robin,
  fewer iterations (fields `*_cold`). What a scheduler step really pays on such a machine.
One call per case per round without blocks (bench.micro's usual round-robin) would be neither: a case's wait
would depend on how long the cases before it in the round took.

Keys are 16 bytes (the connector's xxh3_128 chain hashes) in a connector-shaped namespace, so the frames have the
sizes vLLM sends. Each measurement checks its answer (all 280 found, the commit stored 1), and the daemon's
counters must move by exactly what the cases sent (`expected`), so a broken path fails the run instead of
reporting a fast number.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from bench._common import Case, Samples, interleave
from bench.uds_limit import UdsPeer
from kvstore.client import Client
from kvstore.client.types import Lease, Stats
from kvstore.fastpath import protocol as fp

__all__ = ["LOOKUP_KEYS", "LOOKUP_NS", "TP_NAMESPACES", "RC_BYTES", "COLD_GAP_S", "HOT_BLOCK", "chain_keys",
           "lookup_sizes", "store_chain", "Cases", "counted", "fields", "rows"]

LOOKUP_KEYS = 280                                            # a 142K-token prompt in 512-token blocks
LOOKUP_NS = "vllm/meta-llama/Llama-3.1-8B-Instruct/5f0c3e9a1b7d2468"  # shaped like kvstore_connector/namespace.py's names
RC_BYTES = 4 << 10
TP_NAMESPACES = [LOOKUP_NS[:-1] + str(r) for r in range(8)]  # a TP 8 model's rank namespaces, same name length
COLD_GAP_S = 0.02        # idle time before each cold call: one vLLM step under load
HOT_BLOCK = (20, 4)      # consecutive calls per case and round, of which the first are untimed
COLD = ("uds rtt", "uds echo", "fast echo", "fast lookup", "grpc lookup", "fast probe")
NEW_KEYS = [hashlib.blake2b(f"never-stored/{i}".encode(), digest_size=16).digest() for i in range(4)]
_BLOCK = 16 << 10        # the stored chain's block size (a Lookup's cost does not depend on it)

# What one call of each case makes the daemon count, exactly.
EFFECTS: dict[str, dict[str, int]] = {
    "grpc echo": {}, "grpc lookup": {"lookup_calls": 1},
    "grpc reserve+commit": {"reserve_calls": 1, "committed_blocks": 1},
    "fast echo": {"fast_requests": 1}, "fast lookup": {"lookup_calls": 1, "fast_requests": 1},  # a HITS
    "fast lookup lease": {"lookup_calls": 1, "fast_requests": 2},          # + its untimed Release
    "fast lookup lease+release": {"lookup_calls": 1, "fast_requests": 2},
    "fast reserve+commit": {"reserve_calls": 1, "committed_blocks": 1, "fast_requests": 2},
    "uds rtt": {}, "uds echo": {},
    "fast lookup daemon": {"lookup_calls": 1, "fast_requests": 1},
    "fast probe": {"lookup_calls": 1, "fast_requests": 1}, "fast probe daemon": {"lookup_calls": 1, "fast_requests": 1},
    "fast probe new4": {"lookup_calls": 1, "fast_requests": 1},        # a HITS carrying the 4 missing keys
    "fast probe new4 daemon": {"lookup_calls": 1, "fast_requests": 1},
    "fast probe x8": {"lookup_calls": 8, "fast_requests": 8},
    "fast probe x8 seq": {"lookup_calls": 8, "fast_requests": 8},
}
COUNTERS = ("lookup_calls", "reserve_calls", "committed_blocks")


def chain_keys(tag: str, n: int) -> list[bytes]:
    """n distinct 16-byte keys, the size of the connector's xxh3_128 chain hashes."""
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def lookup_sizes(n: int = LOOKUP_KEYS, ns: str = LOOKUP_NS) -> tuple[int, int]:
    """(request, reply) frame bytes of a fast-path Lookup of n 16-byte keys that all hit, header included,
    from the protocol's own encoders."""
    keys = chain_keys("size", n)
    req = fp.frame(fp.LOOKUP, fp.encode_lookup(ns, keys))
    big = (1 << 40) + 12345  # u64 fields are fixed-width: any values give the real size
    rep = fp.frame(fp.LOOKUP, fp.encode_lookup_reply(n, [True] * n, [1] * n, big, 30_000, big, [big] * n,
                                                     [_BLOCK] * n, [big] * n, [big] * n))
    return len(req), len(rep)


def store_chain(c: Client, keys: list[bytes], namespaces: tuple[str, ...] = (LOOKUP_NS,)) -> None:
    """The chain in each namespace (16 KiB blocks in LOOKUP_NS, 4 KiB in the others: a Lookup's cost does not
    depend on the block size), each checked by a Lookup."""
    for ns in namespaces:
        c.register_namespace(ns)
        value = np.ones(_BLOCK if ns == LOOKUP_NS else 4 << 10, dtype=np.uint8)
        c.put_many(ns, keys, [value] * len(keys))
        found = c.lookup(ns, keys, prefix=True, lease=False).num_prefix
        if found != len(keys):
            raise RuntimeError(f"stored a chain of {len(keys)} keys in {ns} but a lookup finds {found}")


def _fresh(tag: str) -> Iterator[bytes]:
    for i in itertools.count():
        yield hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest()


class Cases:
    """The cases over one fast client, one gRPC client and one raw peer; `calls` counts every call made
    (warm-up and untimed ones too), so `expected()` can say exactly what the daemon must have counted."""

    def __init__(self, fast: Client, grpc: Client, peer: UdsPeer, keys: list[bytes], no_index: Client) -> None:
        """`no_index`: a fast-path client with the shared key index turned off ($KVSTORE_KEY_INDEX=0)."""
        if (fast.control_path, grpc.control_path, no_index.control_path) != ("fast", "grpc", "fast"):
            raise RuntimeError(f"control paths are {fast.control_path}/{grpc.control_path}/{no_index.control_path}, "
                               "expected fast/grpc/fast")
        if (fast.probe_path, no_index.probe_path) != ("index", "daemon"):
            raise RuntimeError(f"probe paths are {fast.probe_path}/{no_index.probe_path}, expected index/daemon")
        self.fast, self.grpc, self.peer, self.keys, self.no_index = fast, grpc, peer, keys, no_index
        self.calls: Counter[str] = Counter()
        self.request = fp.encode_lookup(LOOKUP_NS, keys)
        req_bytes, self.reply_bytes = lookup_sizes(len(keys))
        if len(self.request) + fp.HEADER.size != req_bytes:
            raise RuntimeError("lookup_sizes disagrees with the request this benchmark sends")

    def all(self, gap_s: float = 0.0, only: tuple[str, ...] | None = None) -> dict[str, Case]:
        """The cases, gRPC first; with `gap_s`, each call's untimed setup first sleeps that long (the
        condition measured, not a synchronisation)."""
        made: dict[str, Case] = {}
        for c in (self.grpc, self.fast):
            p = c.control_path
            def echo(_: object, c: Client = c) -> object:
                return c.echo(b"")
            made[f"{p} echo"] = Case(echo)
            made[f"{p} lookup"] = Case(self._lookup(c, False))
            if p == "fast":
                made["fast lookup lease"] = self._leased(c)
                look = self._lookup(c, True)

                def lease_release(_: object, c: Client = c, look: Callable[[Any], Any] = look) -> None:
                    c.release([look(None)], wait=True)
                made["fast lookup lease+release"] = Case(lease_release)
                made["fast lookup daemon"] = Case(self._lookup(self.no_index, False))
                made["fast probe"] = Case(self._probe(c))
                made["fast probe daemon"] = Case(self._probe(self.no_index))
                # an agent's next turn: the stored chain, then 4 blocks never stored (a RAM-only daemon's index
                # is authoritative: the client answers the miss too, and sends its effects one way)
                made["fast probe new4"] = Case(self._probe(c, NEW_KEYS))
                made["fast probe new4 daemon"] = Case(self._probe(self.no_index, NEW_KEYS))
                made["fast probe x8"] = Case(self._probe8(c, pipelined=True))
                made["fast probe x8 seq"] = Case(self._probe8(c, pipelined=False))
            made[f"{p} reserve+commit"] = self._reserve_commit(c)
        made["uds rtt"] = Case(self._rtt)
        made["uds echo"] = Case(lambda _: self.peer.call(fp.ECHO, b""))
        return {k: self._counted(k, v, gap_s) for k, v in made.items() if only is None or k in only}

    def _counted(self, name: str, case: Case, gap_s: float) -> Case:
        inner = case.setup

        def setup() -> Any:
            self.calls[name] += 1
            if gap_s:
                time.sleep(gap_s)
            return inner() if inner is not None else None
        return Case(case.fn, setup, case.teardown)

    def _rtt(self, _: object) -> None:
        if len(self.peer.call(fp.LOOKUP, self.request)) != self.reply_bytes - fp.HEADER.size:
            raise RuntimeError("the raw peer answered with a reply of the wrong size")

    def _lookup(self, c: Client, lease: bool) -> Callable[[object], Lease]:
        keys, n = self.keys, len(self.keys)

        def go(_: object) -> Lease:
            r = c.lookup(LOOKUP_NS, keys, prefix=True, lease=lease)
            if r.num_prefix != n or (lease and not r.id):
                raise RuntimeError(f"lookup ({c.control_path}) found {r.num_prefix} of {n} keys, lease {r.id}")
            return r
        return go

    def _probe(self, c: Client, new: Sequence[bytes] = ()) -> Callable[[object], None]:
        keys, want = self.keys + list(new), (len(self.keys), True)

        def go(_: object) -> None:
            got = c.probe_prefix(LOOKUP_NS, keys)
            if got != want:
                raise RuntimeError(f"the probe ({c.probe_path}) answered {got}, expected {want}")
        return go

    def _probe8(self, c: Client, pipelined: bool) -> Callable[[object], None]:
        keys, want = self.keys, (len(self.keys), True)

        def go(_: object) -> None:
            if pipelined:
                got = c.probe_prefix_many(TP_NAMESPACES, keys)
            else:
                got = min(c.probe_prefix(ns, keys) for ns in TP_NAMESPACES)
            if got != want:
                raise RuntimeError(f"the TP 8 probe ({'pipelined' if pipelined else 'sequential'}) answered {got}")
        return go

    def _leased(self, c: Client) -> Case:
        held: list[Lease] = []
        look = self._lookup(c, True)

        def release(_: object) -> None:
            c.release(held, wait=True)
            held.clear()
        return Case(lambda _: held.append(look(None)), teardown=release)

    def _reserve_commit(self, c: Client) -> Case:
        fresh = _fresh(f"rc-{c.control_path}")

        def go(key: bytes) -> None:
            res = c.reserve(LOOKUP_NS, [key], [RC_BYTES])
            if c.commit(res) != 1:
                raise RuntimeError(f"reserve+commit ({c.control_path}) of a fresh key stored nothing: {res}")
        return Case(go, setup=lambda: next(fresh))

    def expected(self) -> dict[str, int]:
        """What the daemon must have counted for the calls made so far (and no lease left)."""
        want: Counter[str] = Counter({k: 0 for k in (*COUNTERS, "fast_requests")})
        for name, n in self.calls.items():
            for k, v in EFFECTS[name].items():
                want[k] += v * n
        return {**want, "leases_active_after": 0}


def run(cases: Cases, budget: Any, cold_iters: int) -> tuple[dict[str, Samples], dict[str, Samples]]:
    """(hot, cold) samples; `budget` is bench.micro's Budget (its warm-up, rounds and time per case)."""
    hot = budget.run(cases.all(), block=HOT_BLOCK[0], untimed_in_block=HOT_BLOCK[1])
    cold = interleave(cases.all(COLD_GAP_S, only=COLD), warmup=1, min_iters=cold_iters, max_iters=cold_iters,
                      budget_s=0.0)
    return hot, cold


def counted(before: Stats, after: Stats) -> dict[str, int]:
    """How far the daemon's counters moved between two Stats (and the leases still held after)."""
    assert before.control is not None and after.control is not None, "the daemon reports no fast-path counters"
    moved = {k: after.counters.get(k, 0) - before.counters.get(k, 0) for k in COUNTERS}
    moved["fast_requests"] = after.control.fast_requests - before.control.fast_requests
    moved["leases_active_after"] = after.leases_active
    return moved


FIELD = {"uds rtt": "uds_rtt", "uds echo": "uds_echo", "fast echo": "fast_echo", "grpc echo": "grpc_echo",
         "fast lookup": "fast_lookup280", "grpc lookup": "grpc_lookup280", "fast lookup lease": "fast_lookup280_lease",
         "fast lookup lease+release": "fast_lookup280_lease_release", "fast reserve+commit": "fast_reserve_commit",
         "grpc reserve+commit": "grpc_reserve_commit", "fast probe": "fast_probe280",
         "fast lookup daemon": "fast_lookup280_daemon",
         "fast probe daemon": "fast_probe280_daemon", "fast probe x8": "fast_probe280x8",
         "fast probe new4": "fast_probe280_new4", "fast probe new4 daemon": "fast_probe280_new4_daemon",
         "fast probe x8 seq": "fast_probe280x8_seq"}
LABELS = {
    "uds rtt": "limit: raw unix socket, Lookup-sized frames", "uds echo": "limit: raw unix socket, empty frames",
    "fast echo": "fast echo (ECHO: the daemon does nothing)", "grpc echo": "gRPC echo (Health)",
    "fast lookup": "fast Lookup 280 (prefix, no lease)", "grpc lookup": "gRPC Lookup 280 (prefix, no lease)",
    "fast lookup daemon": "fast Lookup 280 (index off)",
    "fast lookup lease": "fast Lookup 280 (prefix, lease; Release untimed)",
    "fast lookup lease+release": "fast Lookup 280 (lease) + Release(wait)",
    "fast reserve+commit": "fast Reserve + Commit (1 x 4 KiB, no copy)",
    "grpc reserve+commit": "gRPC Reserve + Commit (1 x 4 KiB, no copy)",
    "fast probe": "fast probe 280 (shared key index)", "fast probe daemon": "fast probe 280 (index off)",
    "fast probe new4": "fast probe 280 + 4 new (shared key index)",
    "fast probe new4 daemon": "fast probe 280 + 4 new (index off)",
    "fast probe x8": "fast probe 280 x 8 namespaces (TP 8), pipelined",
    "fast probe x8 seq": "fast probe 280 x 8 namespaces, one after another",
}
ROW_TARGETS = {"fast lookup": ("fast_lookup280_us_p50", "fast_lookup280_vs_uds"), "fast echo": ("fast_echo_us_p50",),
               "fast probe": ("fast_probe280_us_p50", "fast_probe280_vs_uds")}


def _us(s: Samples, q: str = "p50") -> float:
    return round(getattr(s, q) * 1e6, 1)


def fields(hot: dict[str, Samples], cold: dict[str, Samples]) -> dict[str, Any]:
    """The JSON fields of this section (µs; ratios unitless): hot without suffix, cold with `_cold`."""
    out: dict[str, Any] = {f"{FIELD[k]}_us_p50": _us(s) for k, s in hot.items()}
    out.update({f"{FIELD[k]}_us_p50_cold": _us(s) for k, s in cold.items()})
    out.update(uds_rtt_us_p99=_us(hot["uds rtt"], "p99"), fast_lookup280_us_p99=_us(hot["fast lookup"], "p99"))
    for suffix, res in (("", hot), ("_cold", cold)):
        out[f"fast_lookup280_vs_uds{suffix}"] = round(res["fast lookup"].p50 / res["uds rtt"].p50, 3)
        if "fast probe" in res:
            out[f"fast_probe280_vs_uds{suffix}"] = round(res["fast probe"].p50 / res["uds rtt"].p50, 3)
        out[f"fast_echo_vs_uds{suffix}"] = round(res["fast echo"].p50 / res["uds echo"].p50, 3)
        out[f"grpc_lookup280_vs_fast{suffix}"] = round(res["grpc lookup"].p50 / res["fast lookup"].p50, 3)
    out["lookup_ratio"] = round(hot["fast lookup"].p50 / hot["fast echo"].p50, 3)
    out["probe_index_vs_daemon"] = round(hot["fast probe"].p50 / hot["fast probe daemon"].p50, 3)
    out["probe_new4_index_vs_daemon"] = round(hot["fast probe new4"].p50 / hot["fast probe new4 daemon"].p50, 3)
    out["lookup_index_vs_daemon"] = round(hot["fast lookup"].p50 / hot["fast lookup daemon"].p50, 3)
    out["tp8_probe_vs_seq"] = round(hot["fast probe x8"].p50 / hot["fast probe x8 seq"].p50, 3)
    out["tp8_probe_vs_lookup"] = round(hot["fast probe x8"].p50 / hot["fast lookup"].p50, 3)
    req, rep = lookup_sizes()
    out.update(uds_request_bytes=req, uds_reply_bytes=rep, control_iters_hot=len(hot["fast lookup"]),
               control_iters_cold=len(cold["fast lookup"]), control_cold_gap_ms=COLD_GAP_S * 1e3,
               control_hot_block=list(HOT_BLOCK))
    return out


def rows(hot: dict[str, Samples], cold: dict[str, Samples]) -> list[list[Any]]:
    """Table rows: hot p50 / p90 / p99, the hot p50 over the raw socket's for the same frames (Lookup-sized for
    Lookups, empty for echoes; none for Reserve + Commit, two round trips of other sizes), the cold p50 and its
    ratio, and last the target fields the row is judged by."""
    out: list[list[Any]] = []
    for k in (k for k in LABELS if k in hot):
        s = hot[k]
        ref = ("uds echo" if k.endswith("echo") else
               "uds rtt" if "lookup" in k or k in ("uds rtt", "fast probe", "fast probe daemon") else None)
        c = cold.get(k)
        out.append([LABELS[k], len(s), f"{s.p50 * 1e6:.1f}", f"{s.p90 * 1e6:.1f}", f"{s.p99 * 1e6:.1f}",
                    f"{s.p50 / hot[ref].p50:.2f}" if ref else "", f"{c.p50 * 1e6:.1f}" if c else "",
                    f"{c.p50 / cold[ref].p50:.2f}" if c and ref else "", ROW_TARGETS.get(k, ())])
    return out
