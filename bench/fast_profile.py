"""Where a fast-path call spends its time: each request followed across both processes, stage by stage.

Why a timeline and not a profiler: a sampling profiler in the daemon cannot say how long the daemon's thread
waited to be woken, nor whether the client's decode overlaps the daemon's metrics; and cProfile's own cost is
larger than the stages measured. Here both processes wrap the functions on the path with a recorder that keeps
(stage, start, end) in CLOCK_MONOTONIC (`time.perf_counter` on Linux: one clock for every process on the box).
Each fast-path request (the client's FastChannel.call) collects the daemon's events inside its window, and its
critical path is cut at the hand-offs:

    client before send | send + delivery + daemon wake-up | daemon until its reply is sent | delivery + client
    wake-up | client after the reply

The daemon's part is split further (decode, tenant check, engine and its parts, arena windows, encode, frame,
glue); its work after its sendall (observe, the next settimeout) overlaps the client's and is listed apart.
Outside the request, the client's own work per API call: encode, decode, building the result, the copy.
Stages are medians over the requests; the wrappers cost ~0.3-0.5 us each, so each scenario's instrumented total
is shown beside an uninstrumented daemon's p50 measured in the same run, and the raw unix-socket limit of the
Lookup's byte counts (bench/uds_limit.py) beside both.

Scenarios (each alone, its calls back to back: hot): lookup = client.lookup(280 stored 16-byte keys, prefix, no
lease: the hit columns come back); probe_prefix = client.probe_prefix(the same keys), what vLLM's scheduler calls.
Every key is in the shared key index, so the client answers both itself and sends their effects one way (HITS):
they make no request to follow, and back to back their pace is the daemon's HITS work (the socket's buffer
fills; the "fast-path requests" row stays 0); put = client.put of one
fresh 256 KiB block into a full arena (a copy into the connection's spare slot, then Store: the commit, a new
spare slot in its reply, and the eviction a full cache pays; the first put asks for spare slots); get = client.get_into of one stored 256 KiB block (every key in the key index: copy, generation
check, a one-way HITS; no lease, so no Lookup or Release to follow).

    python -m bench.fast_profile [--iters 1000] [--keys 280]

The daemon side runs as `python -m bench.fast_profile --events-out F --daemon-argv ...` (DaemonProcess's argv,
with the wrappers installed before kvstore.server.main builds anything); it writes its events at exit.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

Event = tuple[str, float, float, int]  # (stage, start, end, thread id)
EVENTS: list[Event] = []  # list.append is atomic under the GIL: threads may record concurrently


def _wrap(owner: Any, name: str, label: str | Callable[[tuple[Any, ...]], str], static: bool = False) -> None:
    """Record each call of owner.name. A missing name is an error: a profile that silently stops following a
    stage (code renamed under it) reports requests it cannot attribute instead of saying why."""
    orig = getattr(owner, name)
    clock, events, tid = time.perf_counter, EVENTS, threading.get_ident

    def timed(*a: Any, **kw: Any) -> Any:
        t0 = clock()
        try:
            return orig(*a, **kw)
        finally:
            events.append((label if isinstance(label, str) else label(a), t0, clock(), tid()))
    setattr(owner, name, staticmethod(timed) if static else timed)


def _common() -> None:
    from kvstore.fastpath import protocol as fp
    assert fp.HEADER.size == 12
    _wrap(socket.socket, "sendall", "sendall")
    _wrap(socket.socket, "settimeout", "settimeout")
    _wrap(fp.Header, "parse", "parse header", static=True)


def instrument_daemon() -> None:
    from kvstore.engine.engine import Engine
    from kvstore.engine.leases import LeaseTable
    from kvstore.engine.lookups import Lookups
    from kvstore.engine.ram_space import RamSpace
    from kvstore.engine.read_buffer import ReadBuffer
    from kvstore.engine.spares import SpareSlots
    from kvstore.engine.writes import Writes
    from kvstore.fastpath import protocol as fp
    from kvstore.fastpath import spare_bodies as sb
    from kvstore.fastpath.sockets import FrameReader
    from kvstore.server import fast_server
    from kvstore.server.arena_windows import ArenaWindows
    from kvstore.server.metrics import MetricsServer
    from kvstore.server.ops import ControlOps
    from kvstore.server.tenancy import TenantGuard
    _common()
    # a whole frame (header and body, usually one recv_into); its end is the daemon thread's wake-up
    _wrap(FrameReader, "frame", "recv")
    _wrap(fast_server.FastServer, "_answer", lambda a: "answer " + fp.OP_NAMES.get(a[2].op, "?"))
    for name in ("decode_lookup", "decode_reserve", "decode_commit", "decode_release", "decode_u64", "decode_probe"):
        _wrap(fp, name, "decode request")
    for name in ("encode_lookup_reply", "encode_reserve_reply", "encode_count", "encode_probe_reply"):
        _wrap(fp, name, "encode reply")
    for name in ("decode_spare", "decode_store"):
        _wrap(sb, name, "decode request")
    for name in ("encode_spare_reply", "encode_store_reply"):
        _wrap(sb, name, "encode reply")
    _wrap(fp, "frame", "frame")
    _wrap(MetricsServer, "observe", "observe")
    for op in ("lookup", "reserve", "commit", "release", "abort", "probe", "lookup_entries", "spare", "store"):
        _wrap(ControlOps, op, "ops")
        _wrap(Engine, op, "engine")
    for name in ("namespace", "reservation", "own_leases"):
        _wrap(TenantGuard, name, "tenant check")
    for name in ("leased", "reserved", "committed", "released", "aborted", "unwindowed"):
        _wrap(ArenaWindows, name, "arena windows")
    _wrap(Engine, "_check_keys", "engine: check_keys")
    for owner, name in ((Lookups, "locate"), (Lookups, "ram_hits"), (Lookups, "_promote"), (Lookups, "_answer"),
                        (RamSpace, "allocate"), (RamSpace, "evict"), (LeaseTable, "unhold"), (Lookups, "prior_hits"),
                        (Lookups, "holding"), (Writes, "_committed"), (SpareSlots, "grant"), (SpareSlots, "check")):
        _wrap(owner, name, f"engine: {name.lstrip('_')}")
    _wrap(ReadBuffer, "record", "engine: touches")


def instrument_client() -> None:
    from kvstore.client import arena_path, client, control, fast_channel
    from kvstore.fastpath.key_index import IndexView
    from kvstore.fastpath import protocol as fp
    from kvstore.fastpath import spare_bodies as sb
    from kvstore.fastpath.sockets import FrameReader
    _common()
    _wrap(FrameReader, "frame", "recv")  # the reply's header and body: its end is the client's wake-up
    _wrap(fast_channel.FastChannel, "call", lambda a: "call " + fp.OP_NAMES.get(a[1], "?"))
    # Spare and Store go on a named connection, sent (send_on) and answered (reply_on) apart, so that a put of
    # several parts sends each as soon as it is copied: paired_calls makes each pair one "call" window
    _wrap(fast_channel.FastChannel, "send_on", lambda a: "send " + fp.OP_NAMES.get(a[2], "?"))
    _wrap(fast_channel.FastChannel, "reply_on", "reply")
    for name in ("encode_lookup", "encode_reserve", "encode_commit", "encode_release", "encode_probe"):
        _wrap(fp, name, "encode request")
    for name in ("decode_lookup_reply", "decode_reserve_reply", "decode_count", "decode_probe_reply"):
        _wrap(fp, name, "decode reply")
    _wrap(sb, "encode_store", "encode request")
    for name in ("decode_store_reply", "decode_spare_reply"):
        _wrap(sb, name, "decode reply")
    _wrap(IndexView, "probe", "index probe")
    _wrap(control, "Lease", "build result")
    _wrap(control, "Reservation", "build result")
    _wrap(client.Client, "_check_incarnation", "check incarnation")
    _wrap(client.Client, "_write", "copy")
    _wrap(arena_path.SlotWriter, "copy", "copy")
    _wrap(client.Client, "_read", "copy")
    for api in ("lookup", "put", "get_into", "probe_prefix"):
        _wrap(client.Client, api, f"api {api}")


def daemon_main(argv: list[str], out_path: str) -> int:
    """The daemon, instrumented; its events go to `out_path` when it exits (SIGTERM from DaemonProcess.stop)."""
    instrument_daemon()

    def dump() -> None:
        with open(out_path, "w") as fh:
            json.dump(EVENTS, fh)
    atexit.register(dump)
    from kvstore.server.main import main
    return main(argv)


# -- analysis ---------------------------------------------------------------------------------------------------
CRITICAL = ("client before send", "send + delivery + daemon wake-up", "daemon until reply sent",
            "delivery + client wake-up", "client after reply")
DAEMON = ("recv body", "parse header", "settimeout", "decode request", "tenant check", "engine", "arena windows",
          "encode reply", "frame")
CLIENT_API = ("encode request", "decode reply", "build result", "check incarnation", "copy")


def _dur(evs: list[Event], label: str) -> float:
    return sum(e[2] - e[1] for e in evs if e[0] == label)


def _inside(evs: list[Event], t0: float, t1: float) -> list[Event]:
    return [e for e in evs if t0 <= e[1] and e[2] <= t1]


def _last(evs: list[Event], label: str, before: float) -> Event | None:
    found = [e for e in evs if e[0] == label and e[2] <= before]
    return max(found, key=lambda e: e[2]) if found else None


def request_stages(client_evs: list[Event], daemon_evs: list[Event]) -> dict[str, list[dict[str, float]]]:
    """Per fast-path request (grouped by op), the critical-path stages and the daemon's sub-stages (seconds).

    The daemon's side of a client request is the daemon's `answer <op>` of the same op inside the request's
    window, and the events of that daemon thread (one thread per connection): before the answer, the thread's
    last header read (whose end is the wake-up), its parse and its body read. A request with no such answer, or
    two, is left out (counted apart)."""
    by_tid: dict[int, list[Event]] = defaultdict(list)
    for e in daemon_evs:
        by_tid[e[3]].append(e)
    out: dict[str, list[dict[str, float]]] = defaultdict(list)
    for w in (e for e in client_evs if e[0].startswith("call ")):
        name, w0, w1, ctid = w
        op = name[len("call "):]
        # the answer starts inside the window; it may end after it (observe runs while the client goes on)
        answers = [e for e in daemon_evs if e[0] == "answer " + op and w0 <= e[1] <= w1]
        if len(answers) != 1:
            out["unattributed " + op].append({})
            continue
        ans = answers[0]
        mine = by_tid[ans[3]]
        parse = _last(mine, "parse header", ans[1])
        head = _last(mine, "recv", parse[1]) if parse else None
        d_send = [e for e in _inside(mine, ans[1], ans[2]) if e[0] == "sendall"]
        c = [e for e in _inside(client_evs, w0, w1) if e[3] == ctid and e is not w]
        c_send = [e for e in c if e[0] == "sendall"]
        c_recv = sorted((e for e in c if e[0] == "recv"), key=lambda e: e[1])
        if parse is None or head is None or head[2] < w0 or len(d_send) != 1 or len(c_send) != 1 or not c_recv:
            out["unattributed " + op].append({})
            continue
        d_wake, d_sent, c_head = head[2], d_send[0], c_recv[0]
        before = _inside(mine, d_wake, d_sent[1])
        # cut at causal points only (each follows the one before), so the stages are >= 0 and add up to the
        # total even when a sendall returns after its peer woke (the woken thread may run first on its CPU)
        s: dict[str, float] = {
            "client before send": c_send[0][1] - w0, "send + delivery + daemon wake-up": d_wake - c_send[0][1],
            "daemon until reply sent": d_sent[1] - d_wake, "delivery + client wake-up": c_head[2] - d_sent[1],
            "client after reply": w1 - c_head[2], "request total": w1 - w0,
            "client sendall (overlaps)": c_send[0][2] - c_send[0][1], "daemon sendall (overlaps)": d_sent[2] - d_sent[1],
            "daemon after reply (overlaps)": ans[2] - d_sent[2],
        }
        for label in DAEMON:
            s[f"daemon: {label}"] = _dur(before, label)
        s["daemon: recv body"] = _dur(before, "recv")
        ops_total = _dur(before, "ops")
        s["daemon: ops glue"] = ops_total - sum(s[f"daemon: {k}"] for k in ("tenant check", "engine", "arena windows"))
        s["daemon: other (dispatch, loop, wrappers)"] = s["daemon until reply sent"] - ops_total - sum(
            s[f"daemon: {k}"] for k in DAEMON if k not in ("tenant check", "engine", "arena windows"))
        for label in sorted({e[0] for e in before if e[0].startswith("engine: ")}):
            s[f"daemon: {label}"] = _dur(before, label)
        out[op].append(s)
    return out


def paired_calls(evs: list[Event]) -> list[Event]:
    """`evs` plus a "call <op>" window from each "send <op>" to its "reply" (replies come in the order of the
    sends, per thread), as FastChannel.call records one; the send and reply events themselves are dropped."""
    out, waiting = [], defaultdict(list)  # thread -> its sends not yet answered
    for e in sorted(evs, key=lambda e: e[1]):
        if e[0].startswith("send "):
            waiting[e[3]].append(e)
        elif e[0] == "reply" and waiting[e[3]]:
            sent = waiting[e[3]].pop(0)
            out.append(("call " + sent[0][len("send "):], sent[1], e[2], e[3]))
        elif e[0] != "reply":
            out.append(e)
    return out


def api_stages(client_evs: list[Event]) -> dict[str, list[dict[str, float]]]:
    """Per client API call (lookup, put, get_into), its total and the client's own work inside it, on its
    thread (seconds); the requests inside it are in request_stages."""
    out: dict[str, list[dict[str, float]]] = defaultdict(list)
    for name, t0, t1, tid in (e for e in client_evs if e[0].startswith("api ")):
        inside = [e for e in _inside(client_evs, t0, t1) if e[3] == tid and not e[0].startswith("api ")]
        s = {"api total": t1 - t0, **{f"client: {k}": _dur(inside, k) for k in CLIENT_API}}
        s["fast-path requests"] = sum(e[2] - e[1] for e in inside if e[0].startswith("call "))
        s["client: other"] = s["api total"] - s["fast-path requests"] - sum(s[f"client: {k}"] for k in CLIENT_API)
        out[name[len("api "):]].append(s)
    return out


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for r in rows for k in r}
    if not keys:
        return {}
    return {k: round(statistics.median(r.get(k, 0.0) for r in rows) * 1e6, 1) for k in sorted(keys)}


def p50_us(fn: Callable[[], object], iters: int, warmup: int = 50) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return round(statistics.median(ts) * 1e6, 1) if ts else 0.0


def scenarios(c: Any, n_keys: int) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """name -> (prepare, call): each scenario runs alone, its calls back to back, after its preparation, on a
    daemon whose arena was filled first (so puts evict)."""
    import itertools

    import numpy as np

    from bench.control_plane import LOOKUP_NS, chain_keys, store_chain
    keys = chain_keys("profile", n_keys)
    block = np.ones(256 << 10, dtype=np.uint8)
    filler = (k for i in itertools.count() for k in chain_keys(f"fill{i}", 64))
    c.register_namespace(LOOKUP_NS)
    for _ in range(20):  # 20 x 64 x 256 KiB = 320 MiB: more than the 256 MiB arena, so it evicts from here on
        c.put_many(LOOKUP_NS, [next(filler) for _ in range(64)], [block] * 64)
    got, buf = chain_keys("got", 1)[0], np.empty_like(block)

    def lookup() -> None:
        if c.lookup(LOOKUP_NS, keys, prefix=True, lease=False).num_prefix != n_keys:
            raise RuntimeError("the profiled lookup missed stored keys")

    def put() -> None:
        if not c.put(LOOKUP_NS, next(filler), block):
            raise RuntimeError("a put of a fresh key was not stored")

    def get() -> None:
        if c.get_into(LOOKUP_NS, got, buf) is None:
            raise RuntimeError("the profiled get missed")
    def probe() -> None:
        if c.probe_prefix(LOOKUP_NS, keys) != (n_keys, True):
            raise RuntimeError("the profiled probe missed stored keys")
    return {"lookup": (lambda: store_chain(c, keys), lookup), "probe_prefix": (lambda: store_chain(c, keys), probe),
            "put": (lambda: None, put),
            "get_into": (lambda: c.put(LOOKUP_NS, got, block), get)}


def run(n_keys: int = 280, iters: int = 1000) -> dict[str, Any]:
    from bench.control_plane import lookup_sizes
    from bench.uds_limit import UdsPeer
    from kvstore.client.fast_channel import DEFAULT_SPIN_US
    from kvstore.fastpath.sockets import DAEMON_SPIN_US
    from kvstore.client import Client
    from kvstore.fastpath import protocol as fp
    from kvstore.testing import DaemonProcess

    out: dict[str, Any] = {"keys": n_keys, "iters": iters, "plain_p50_us": {}}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # `bench` importable from any cwd
    env = {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryDirectory(prefix="kvstore-fast-profile-") as tmp:
        events_path = os.path.join(tmp, "daemon-events.json")
        plain, inst = DaemonProcess(arena_bytes="256MiB"), DaemonProcess(arena_bytes="256MiB", env=env)
        inst.args[1:3] = ["-m", "bench.fast_profile", "--events-out", events_path, "--daemon-argv"]
        for d in (plain, inst):
            with d, Client(d.address, control="fast") as c:
                calls = scenarios(c, n_keys)
                if d is plain:
                    for name, (prepare, call) in calls.items():
                        prepare()
                        out["plain_p50_us"][name] = p50_us(call, iters)
                    out["plain_p50_us"]["echo"] = p50_us(lambda: c.echo(b""), iters)
                    assert d.proc is not None
                    out["daemon_threads"] = len(os.listdir(f"/proc/{d.proc.pid}/task"))
                    continue
                for prepare, call in calls.values():  # warm-up, before the client's wrappers
                    prepare()
                    p50_us(call, 0)
                instrument_client()
                EVENTS.clear()
                for prepare, call in calls.values():
                    prepare()
                    p50_us(call, iters, warmup=0)
                client_evs = paired_calls(list(EVENTS))
            with open(events_path) as fh:
                daemon_evs = sorted((tuple(e) for e in json.load(fh)), key=lambda e: e[1])
    if not daemon_evs:
        raise RuntimeError(f"the instrumented daemon recorded nothing (its log: {inst.log_path})")
    req = request_stages(client_evs, daemon_evs)
    out["requests_attributed"] = {k: len(v) for k, v in req.items()}
    out["request_stages_us_p50"] = {k: medians(v) for k, v in req.items() if not k.startswith("unattributed")}
    out["api_stages_us_p50"] = {k: medians(v) for k, v in api_stages(client_evs).items()}
    req_bytes, rep_bytes = lookup_sizes(n_keys)
    with UdsPeer({fp.LOOKUP: rep_bytes - fp.HEADER.size}, spin_us=DEFAULT_SPIN_US, peer_spin_us=DAEMON_SPIN_US) as peer:
        body = bytes(req_bytes - fp.HEADER.size)
        out["uds_rtt_p50_us"] = p50_us(lambda: peer.call(fp.LOOKUP, body), iters)
        out["uds_echo_p50_us"] = p50_us(lambda: peer.call(fp.ECHO, b""), iters)
    out["uds_request_bytes"], out["uds_reply_bytes"] = req_bytes, rep_bytes
    return out


def report(out: dict[str, Any]) -> None:
    from bench._common import print_table
    req = out["request_stages_us_p50"]
    ops = [op for op in ("Lookup", "Probe", "Reserve", "Commit", "Release", "Spare", "Store") if op in req]
    names = list(CRITICAL) + ["request total"] + sorted({k for op in ops for k in req[op]} - set(CRITICAL)
                                                        - {"request total"})
    print_table("each fast-path request (µs p50; the first five rows are its critical path; 'daemon: engine: *' "
                "are parts of 'daemon: engine')", ["stage", *(f"{op} (n={out['requests_attributed'][op]})"
                                                              for op in ops)],
                [[k, *(req[op].get(k, "") for op in ops)] for k in names])
    api = out["api_stages_us_p50"]
    calls = list(api)
    print_table(f"client API calls (µs p50, hot; 280-key lookup; 256 KiB put/get_into); raw unix socket of the "
                f"Lookup's frames ({out['uds_request_bytes']} B / {out['uds_reply_bytes']} B): "
                f"{out['uds_rtt_p50_us']} µs, empty: {out['uds_echo_p50_us']} µs",
                ["", *calls], [[k, *(api[a].get(k, "") for a in calls)] for k in api[calls[0]]]
                + [["uninstrumented p50", *(out["plain_p50_us"][a] for a in calls)]])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--daemon-argv" in argv:  # the instrumented daemon (started by run())
        i = argv.index("--daemon-argv")
        ap = argparse.ArgumentParser()
        ap.add_argument("--events-out", required=True)
        sys.exit(daemon_main(argv[i + 1:], ap.parse_args(argv[:i]).events_out))
    ap = argparse.ArgumentParser(prog="python -m bench.fast_profile", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=280, help="keys of the profiled Lookup")
    ap.add_argument("--iters", type=int, default=1000, help="calls of each scenario")
    args = ap.parse_args(argv)
    out = run(args.keys, args.iters)
    report(out)
    from bench._common import emit_json
    emit_json(out)


if __name__ == "__main__":
    main()
