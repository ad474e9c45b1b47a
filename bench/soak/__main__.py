"""`python -m bench.soak --minutes M [--clients N]`: chaos soak, loopback only.

N client processes put, get and look up blocks whose bytes derive from their keys (every byte read is
verified) while the driver SIGKILLs and restarts the daemon, SIGKILLs clients holding leases and clients
mid-operation, fills the disk tier, restarts a peer (with etcd installed) and fuzzes every RPC and the data
port. Then: zero wrong bytes, leases and reservations drained, every listed block verified (also after one
more kill -9 and restart), the stopped disk tier opened offline with no index entry dropped and every record
verified, every arena slot back after clearing, and the clients' tenant keeps its disk quota
(tenant_disk_quota) through a last burst of the quota-less fill tenant. The last line is one JSON object;
exit 1 when an invariant fails.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from typing import Any

from bench._common import emit_json
from bench.soak.checks import Verified, drain, leaked_slots, offline_disk, tenant_disk, verify_live
from bench.soak.driver import Soak, SoakConfig
from bench.soak.values import SOAK_TENANT

MIB = 1 << 20


def _worker_totals(paths: list[str]) -> dict:
    out: dict[str, Any] = {"ops": 0, "bytes_verified": 0, "wrong_bytes": 0, "hits": 0, "misses": 0, "errors": {}}
    for p in paths:
        try:
            with open(p) as fh:
                s = json.load(fh)
        except (OSError, ValueError):
            continue
        for k in ("ops", "bytes_verified", "wrong_bytes", "hits", "misses"):
            out[k] += s.get(k, 0)
        for k, v in s.get("errors", {}).items():
            out["errors"][k] = out["errors"].get(k, 0) + v
    return out


def run(cfg: SoakConfig) -> dict:
    t0 = time.monotonic()
    with ExitStack() as stack:
        soak = Soak(cfg, stack)
        soak.run()
        workers = _worker_totals(soak.tally.stats_files)
        daemons = soak.daemons
        stats = [drain(d) for d in daemons]
        live = Verified()
        for d in daemons:
            live.add(verify_live(d))
        floor_before, quota = tenant_disk(soak.a, SOAK_TENANT)
        soak._fill()   # a last burst of the quota-less tenant, 1.5x the disk: the soak tenant keeps its floor
        floor_after, _ = tenant_disk(soak.a, SOAK_TENANT)
        soak.restart(soak.a)  # one more kill -9: what the disk tier recovered must verify too
        after_kill = verify_live(soak.a)
        a_disk = soak.a.args[soak.a.args.index("--disk-dir") + 1]
        soak.a.stop(signal.SIGTERM)
        disk = offline_disk(a_disk, cfg.disk_bytes, MIB)
        soak.a._log.close()  # type: ignore[union-attr]  # the daemon was started: its log is open
        soak.a.start(timeout_s=60)
        leaks, final = 0, []
        for d in daemons:
            n, s = leaked_slots(d)
            leaks += n
            final.append(s)
    wrong = workers["wrong_bytes"] + live.wrong_bytes + after_kill.wrong_bytes + disk["wrong_bytes"]
    out = {
        "benchmark": "soak", "minutes": cfg.minutes, "clients": cfg.clients, "peer": len(daemons) > 1,
        "faults_injected": dict(soak.tally.faults), "faults_total": sum(soak.tally.faults.values()),
        "rpcs_fuzzed": soak.fuzz.rpcs, "frames_fuzzed": soak.fuzz.frames,
        "fuzz_internal_errors": len(soak.fuzz.internal), "fuzz_codes": dict(soak.fuzz.codes),
        "client_ops": workers["ops"], "client_hits": workers["hits"], "client_misses": workers["misses"],
        "client_errors": workers["errors"],
        "bytes_verified": workers["bytes_verified"] + live.bytes + after_kill.bytes + disk["bytes"],
        "blocks_verified_at_end": live.blocks, "blocks_verified_after_kill": after_kill.blocks,
        "disk_blocks_verified_offline": disk["blocks"], "disk_dropped_entries": disk["dropped_entries"],
        "disk_read_failures": disk["read_failures"], "fill_blocks": soak.tally.fill_blocks,
        "wrong_bytes": wrong, "leaked_slots": leaks,
        "tenant_disk_quota": quota, "tenant_disk_before_burst": floor_before,
        "tenant_disk_after_burst": floor_after,
        "arena_allocated_after_clear": sum(s.allocated_bytes for s in final),
        "leases_after_drain": sum(s.leases_active for s in stats),
        "reservations_after_drain": sum(s.reservations_active for s in stats),
        "tmpfs": bool(soak.tmpfs), "disk_degraded_seen": soak.tally.degraded_seen,
        "disk_recovered": soak.tally.recovered, "seconds": round(time.monotonic() - t0, 1),
    }
    out["ok"] = (wrong == 0 and leaks == 0 and floor_after >= min(floor_before, quota) and quota > 0 and out["arena_allocated_after_clear"] == 0
                 and disk["dropped_entries"] == 0 and disk["read_failures"] == 0 and not soak.fuzz.internal
                 and out["leases_after_drain"] == 0 and out["reservations_after_drain"] == 0)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=5.0, help="length of the fault phase [5]")
    p.add_argument("--clients", type=int, default=3, help="read/write client processes [3]")
    p.add_argument("--keyspace", type=int, default=3000, help="distinct keys the clients use [3000]")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-peer", dest="peer", action="store_false", help="no second daemon / etcd")
    p.add_argument("--workdir", default="", help="keep logs and state here (default: a temporary directory)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--json-out", default=None)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvstore-soak-") as tmp:
        workdir = a.workdir or tmp
        os.makedirs(workdir, mode=0o700, exist_ok=True)
        cfg = SoakConfig(minutes=a.minutes, clients=a.clients, keyspace=a.keyspace, seed=a.seed, peer=a.peer,
                         workdir=workdir, verbose=not a.quiet)
        out = run(cfg)
    emit_json(out, a.json_out)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
