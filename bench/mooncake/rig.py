"""Mooncake Store's remote get, set up for bench.remote: a master and two store processes in a network
namespace of their own, driven from the benchmark's process.

Why a namespace: mooncake_master's HTTP metadata server binds 0.0.0.0 and the transfer engine binds the first
non-loopback interface, so on the host they would listen on (and could talk over) the machine's real network.
Inside `ip netns add` there is only what this file puts there: loopback and one veth pair whose two ends both
live in the namespace, with addresses of their own (10.213.0.1 and .2). Traffic between two local addresses
is routed over the namespace's loopback, so nothing can leave the machine, and Mooncake's TCP transport
crosses the same kind of loopback path as kvstore's and the raw socket's. `loopback_bytes()` reads the
namespace's lo counters, so bench.remote checks once that a get really moved its bytes over TCP.

    MooncakeRig(venv, block, batch)   namespace, master, holder (owns the blocks), getter (reads them)
      get() -> Timed                  one batch_get_into of every block, timed inside the getter
      digests() -> [hex]              the getter's buffer, block by block (the holder's are .expected)
      close()                         stops everything and deletes the namespace (also on errors)

The store processes run bench/mooncake/peer.py under the Mooncake venv (bench/mooncake/setup_venv.sh; none of
Mooncake's code is in this repository) with the CUDA stub and the CUDA runtime on LD_LIBRARY_PATH.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import time
from pathlib import Path

from bench._common import Timed

__all__ = ["MooncakeRig", "missing", "SETUP_HINT", "DEFAULT_VENV"]

HERE = Path(__file__).resolve().parent
DEFAULT_VENV = HERE.parent.parent / ".venv-mooncake"
SETUP_HINT = "make setup-mooncake (bash bench/mooncake/setup_venv.sh): a bench-only venv, never the main one"
_MASTER_RPC, _MASTER_HTTP = 50051, 8080   # inside a fresh namespace: nothing else listens there
_HOLDER, _GETTER = "10.213.0.1", "10.213.0.2"


def missing(venv: Path = DEFAULT_VENV) -> str | None:
    """Why the comparison cannot run here, or None when it can."""
    if not (venv / ".installed-stamp").exists():
        return f"no Mooncake venv at {venv}: {SETUP_HINT}"
    if shutil.which("ip") is None:
        return "no `ip` command (apt-get install -y iproute2)"
    if os.geteuid() != 0:
        return "creating a network namespace needs root"
    return None


def _readline(p: subprocess.Popen[str], timeout_s: float) -> str:
    """The process's next line, or "" when it sends none within timeout_s (or exits)."""
    assert p.stdout is not None
    if not select.select([p.stdout], [], [], timeout_s)[0]:
        return ""
    return p.stdout.readline()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class MooncakeRig:
    def __init__(self, venv: Path, block: int, batch: int) -> None:
        self.ns = f"kvstore-bench-{os.getpid()}"
        self._procs: list[subprocess.Popen[str]] = []
        self._first: dict[int, str] = {}   # pid -> the peer's first line ("ok ...")
        self._made_ns = False
        sp = next((venv / "lib").glob("python3*/site-packages"), None)
        if sp is None:
            raise RuntimeError(f"{venv} has no site-packages: rebuild it ({SETUP_HINT})")
        self._env = {**os.environ, "LD_LIBRARY_PATH": f"{venv / 'cuda-stub'}:{sp / 'nvidia/cuda_runtime/lib'}",
                     "MC_STORE_MEMCPY": "0"}   # never a local memcpy shortcut: the bytes cross the transport
        self._py = str(venv / "bin" / "python")
        try:
            self._namespace()
            self._start(str(venv / "bin" / "mooncake_master"), "-rpc_address=127.0.0.1", f"-rpc_port={_MASTER_RPC}",
                        "-enable_http_metadata_server=true", f"-http_metadata_server_port={_MASTER_HTTP}",
                        stdin=False)
            common = ["--metadata", f"http://127.0.0.1:{_MASTER_HTTP}/metadata", "--master",
                      f"127.0.0.1:{_MASTER_RPC}", "--block", str(block), "--batch", str(batch)]
            self._holder = self._peer("holder", _HOLDER, common)
            self.expected = self._ask(self._holder, None).split(",")
            self._getter = self._peer("getter", _GETTER, common)
            self._ask(self._getter, None)
        except BaseException:
            self.close()
            raise

    def _namespace(self) -> None:
        _ip("netns", "add", self.ns)
        self._made_ns = True
        _ip("-n", self.ns, "link", "set", "lo", "up")
        _ip("-n", self.ns, "link", "add", "mc0", "type", "veth", "peer", "name", "mc1")
        for dev, addr in (("mc0", _HOLDER), ("mc1", _GETTER)):
            _ip("-n", self.ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", self.ns, "link", "set", dev, "up")

    def _start(self, *argv: str, stdin: bool = True) -> subprocess.Popen[str]:
        p = subprocess.Popen(["ip", "netns", "exec", self.ns, *argv], env=self._env, text=True,
                             stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                             stdout=subprocess.PIPE if stdin else subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._procs.append(p)
        return p

    def _peer(self, role: str, host: str, common: list[str]) -> subprocess.Popen[str]:
        deadline = time.monotonic() + 30
        while True:  # the master takes a moment to listen
            p = self._start(self._py, str(HERE / "peer.py"), role, "--host", host, *common)
            first = _readline(p, 60)
            if first.startswith("ok"):
                self._first[p.pid] = first
                return p
            p.kill()
            p.wait()
            self._procs.remove(p)
            if time.monotonic() > deadline:
                raise RuntimeError(f"Mooncake {role} did not start: {first.strip() or 'no answer'}")
            time.sleep(0.5)

    def _ask(self, p: subprocess.Popen[str], cmd: str | None) -> str:
        """The answer to `cmd` (None: the peer's first line) without its "ok "; RuntimeError for an error."""
        if cmd is None:
            line = self._first[p.pid]
        else:
            assert p.stdin is not None
            p.stdin.write(cmd + "\n")
            p.stdin.flush()
            line = _readline(p, 120)
        if not line.startswith("ok"):
            raise RuntimeError(f"Mooncake peer: {line.strip() or 'exited'}")
        return line[3:].strip()

    def get(self, _: object = None) -> Timed:
        return Timed(float(self._ask(self._getter, "get")))

    def digests(self) -> list[str]:
        return self._ask(self._getter, "check").split(",")

    def loopback_bytes(self) -> int:
        """Bytes the namespace's loopback has received so far (Mooncake's transfers cross it)."""
        out = subprocess.run(["ip", "-n", self.ns, "-s", "link", "show", "lo"], check=True, capture_output=True,
                             text=True).stdout.split("\n")
        rx = next(i for i, line in enumerate(out) if line.strip().startswith("RX:"))
        return int(out[rx + 1].split()[0])

    def close(self) -> None:
        """Peers are asked to quit (they close their stores first), the master is terminated, and whatever
        does not exit within 5 s is killed; then the namespace goes."""
        for p in reversed(self._procs):
            try:
                if p.stdin is not None:
                    p.stdin.write("quit\n")
                    p.stdin.flush()
                else:
                    p.terminate()
            except OSError:
                pass
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs.clear()
        if self._made_ns:
            subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
            self._made_ns = False
