"""A hostile local client of kvstore-server, run as its own process by tests/test_arena_isolation.py.

It does everything a tenant's process could do to reach other tenants' bytes through shared memory, and
reports what worked as one JSON object on stdout:

- asks the daemon's arena socket for its arena file with its token (the legitimate way in), and also with no
  token and with a made-up one;
- measures how much memory the file it got holds, then maps all of it and counts a marker in it;
- unless --no-write, overwrites every byte it mapped (its own file: another tenant's blocks must not change);
- tries to shrink or grow its file (would SIGBUS the daemon if it worked) and to remove the seals;
- looks for arena files in /dev/shm, and tries to open the daemon's descriptors, mapped files and memory
  through /proc/<daemon pid> (fails when the daemon is non-dumpable and this process lacks CAP_SYS_PTRACE:
  the test runs it under `setpriv --bounding-set=-sys_ptrace`).
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import mmap
import os
import sys

from kvstore.client.fast_channel import request_arena
from kvstore.errors import KVStoreError


def _refusal(fn) -> str:
    try:
        fn()
    except KVStoreError as exc:
        return exc.reason
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return "allowed"


def _proc_attempts(pid: int) -> dict[str, list[str]]:
    opened: list[str] = []
    denied: list[str] = []
    for sub in ("fd", "map_files"):
        base = f"/proc/{pid}/{sub}"
        try:
            names = os.listdir(base)
        except OSError:
            denied.append(base)
            continue
        for name in names:
            path = f"{base}/{name}"
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                denied.append(path)
                continue
            opened.append(os.readlink(f"/proc/self/fd/{fd}"))
            os.close(fd)
    try:
        os.close(os.open(f"/proc/{pid}/mem", os.O_RDONLY))
        opened.append(f"/proc/{pid}/mem")
    except OSError:
        denied.append(f"/proc/{pid}/mem")
    return {"opened": opened, "denied": denied}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--token-file", required=True)
    ap.add_argument("--marker", action="append", default=[], help="hex bytes to count (repeatable)")
    ap.add_argument("--daemon-pid", type=int, default=0)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    with open(args.token_file, encoding="utf-8") as fh:
        token = fh.read().strip()
    report: dict[str, object] = {
        "no_token": _refusal(lambda: request_arena(args.socket, "")),
        "bad_token": _refusal(lambda: request_arena(args.socket, "not-a-token-but-long-enough")),
    }
    fd, _ = request_arena(args.socket, token)
    size = os.fstat(fd).st_size
    report["size"] = size
    report["resident_bytes"] = os.fstat(fd).st_blocks * 512
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    data = mm[:]
    report["counts"] = {m: data.count(bytes.fromhex(m)) for m in args.marker}
    del data
    if not args.no_write:
        chunk = b"\xee" * (1 << 20)
        for pos in range(0, size, len(chunk)):
            n = min(len(chunk), size - pos)
            mm[pos: pos + n] = chunk[:n]
        report["overwritten_bytes"] = size
    report["shrink"] = _refusal(lambda: os.ftruncate(fd, 0))
    report["grow"] = _refusal(lambda: os.ftruncate(fd, size * 2))
    report["unseal"] = _refusal(lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE))
    report["dev_shm"] = sorted(n for n in os.listdir("/dev/shm") if "kvstore" in n)
    if args.daemon_pid:
        report["proc"] = _proc_attempts(args.daemon_pid)
    mm.close()
    os.close(fd)
    json.dump(report, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
