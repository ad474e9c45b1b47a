"""The short chaos soak (bench.soak, ~35 s): every fault kind injected, zero wrong bytes, zero leaked slots,
disk tier consistent with its index, no INTERNAL from the fuzzer. `python -m bench.soak --minutes M` for longer."""

from __future__ import annotations

import json
import subprocess
import sys

from kvstore.testing import etcd_binary
from tests.required import missing


def test_short_soak() -> None:
    r = subprocess.run([sys.executable, "-m", "bench.soak", "--minutes", "0.5", "--clients", "2", "--quiet"],
                       capture_output=True, text=True, timeout=240)
    lines = r.stdout.strip().splitlines()
    assert lines, r.stderr[-3000:]
    out = json.loads(lines[-1])
    assert r.returncode == 0 and out["ok"], out
    assert out["wrong_bytes"] == 0 and out["leaked_slots"] == 0 and out["arena_allocated_after_clear"] == 0
    kinds = {"kill_daemon", "kill_lease_holder", "disk_fill", "kill_client"}
    if etcd_binary() is None:  # the soak then runs without its peer node: fail that under CI
        missing("etcd", "make setup installs Debian's etcd-server")
    kinds.add("restart_peer")
    if out["tmpfs"]:  # root: the disk tier sat on a small tmpfs that a filler file made full
        kinds.add("disk_enospc")
        assert out["disk_degraded_seen"] == 1 and out["disk_recovered"] == 1
    assert kinds <= set(out["faults_injected"]), out["faults_injected"]
    assert out["rpcs_fuzzed"] > 100 and out["fuzz_internal_errors"] == 0
    assert out["bytes_verified"] > 0 and out["disk_dropped_entries"] == 0 and out["disk_read_failures"] == 0
    assert out["disk_blocks_verified_offline"] > 0 and out["blocks_verified_after_kill"] > 0
    quota = out["tenant_disk_quota"]
    assert quota == 4 << 20 and out["tenant_disk_after_burst"] >= min(out["tenant_disk_before_burst"], quota), out
