"""Tenant isolation of the arena's bytes, tried by a hostile tenant process (tests/arena_adversary.py).

The promise (docs/security.md): with tokens, a tenant's process can map, read or write only its own tenant's
arena memory. Each test starts a real daemon with two tenants' tokens; the adversary is a separate process
with bob's token, run without CAP_SYS_PTRACE (`setpriv`), as a process of the daemon's own user would be.
Before per-tenant arena files, bob mapped /dev/shm/kvstore-<node> and found alice's marker in it; its
overwrite then changed what alice read back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore import Client
from kvstore.testing import DaemonProcess
from tests.tenant_helpers import A_NS, ALICE_TOKEN, B_NS, BOB_TOKEN, secret

MIB = 1 << 20
ADVERSARY = Path(__file__).with_name("arena_adversary.py")


@pytest.fixture()
def tenants(tmp_path: Path):
    tokens = secret(str(tmp_path / "tokens"), f"alice {ALICE_TOKEN}\nbob {BOB_TOKEN}\n")
    return tokens, secret(str(tmp_path / "alice"), ALICE_TOKEN), secret(str(tmp_path / "bob"), BOB_TOKEN)


def adversary(d: DaemonProcess, token_file: str, markers: list[bytes], *, write: bool = True) -> dict:
    cmd = ["setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace", sys.executable, str(ADVERSARY),
           "--socket", d.socket_path + ".arena", "--token-file", token_file, "--daemon-pid", str(d.proc.pid)]
    for m in markers:
        cmd += ["--marker", m.hex()]
    if not write:
        cmd.append("--no-write")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_tenant_cannot_read_or_write_another_tenants_arena(tenants) -> None:
    tokens, alice_tf, bob_tf = tenants
    marker = os.urandom(32)
    blocks = [marker * (256 * 1024 // 32) for _ in range(8)]
    keys = [b"a%d" % i for i in range(8)]
    with DaemonProcess(tokens_file=tokens, arena_bytes="32MiB", max_block_bytes="1MiB") as d, \
            Client(d.address, token_file=alice_tf) as alice, Client(d.address, token_file=bob_tf) as bob:
        assert alice.mode == "arena" and bob.mode == "arena"
        assert alice.health().arena_bytes > 0
        alice.register_namespace(A_NS)
        bob.register_namespace(B_NS)
        assert alice.put_many(A_NS, keys, blocks).stored == 8

        rep = adversary(d, bob_tf, [marker])
        layout_size = alice.arena_span[1]  # type: ignore[index]  # alice maps the arena: its span is set
        assert rep["size"] == layout_size
        assert rep["counts"] == {marker.hex(): 0}          # nothing of alice's in any memory bob can map
        assert rep["overwritten_bytes"] == layout_size     # ... and bob scribbled over all of it
        assert rep["no_token"] == "unauthenticated" and rep["bad_token"] == "unauthenticated"
        assert (rep["shrink"], rep["grow"], rep["unseal"]) == ("EPERM", "EPERM", "EPERM")  # sealed: no SIGBUS
        assert [n for n in rep["dev_shm"] if d.node_id in n] == []  # no named arena to open
        assert rep["proc"]["opened"] == []                 # the daemon is non-dumpable: no /proc/<pid>/fd way in
        assert f"/proc/{d.proc.pid}/mem" in rep["proc"]["denied"]

        assert alice.get_many(A_NS, keys) == blocks        # alice's bytes are exactly what she stored
        # positive control: the same scan in alice's own file finds every copy of her marker, exactly
        own = adversary(d, alice_tf, [marker], write=False)
        assert own["counts"] == {marker.hex(): 8 * 256 * 1024 // 32}
        # bob's own data path still works after he trashed his mapping (new slots, new bytes)
        assert bob.put(B_NS, b"b0", b"\x42" * 300_000) is True
        assert bob.get(B_NS, b"b0") == b"\x42" * 300_000
        assert d.proc.poll() is None


def test_slabs_move_between_tenants_without_their_bytes_and_give_memory_back(tenants) -> None:
    """16 slabs of 1 MiB. alice fills 14 and deletes them (they stay bound to her file, empty); bob then
    stores 15: 2 come from the shared pool, 13 move from alice's file to his (kernel-zeroed pages in his file,
    punched out of hers)."""
    tokens, alice_tf, bob_tf = tenants
    a_mark, b_mark = os.urandom(32), os.urandom(32)
    per_block = MIB // 32
    opts = dict(tokens_file=tokens, arena_bytes="16MiB", max_block_bytes="1MiB", high_watermark=1.0,
                low_watermark=1.0)
    with DaemonProcess(**opts) as d, Client(d.address, token_file=alice_tf) as alice, \
            Client(d.address, token_file=bob_tf) as bob:
        alice.register_namespace(A_NS)
        bob.register_namespace(B_NS)
        a_keys = [b"a%02d" % i for i in range(14)]
        assert alice.put_many(A_NS, a_keys, [a_mark * per_block] * 14).stored == 14
        assert alice.delete(A_NS, a_keys) == 14
        b_keys = [b"b%02d" % i for i in range(15)]
        b_blocks = [b_mark * per_block] * 15
        assert bob.put_many(B_NS, b_keys, b_blocks).stored == 15
        assert bob.stats().counters["slab_binds"] == 14 + 15  # alice took 14 from the pool, bob 2 + 13

        gen_table = 16 * 4096  # one page of generations per 1 MiB slab (kvstore/arena/layout.py)
        b_rep = adversary(d, bob_tf, [a_mark, b_mark], write=False)
        assert b_rep["counts"] == {a_mark.hex(): 0, b_mark.hex(): 15 * per_block}
        assert b_rep["resident_bytes"] == gen_table + 15 * MIB
        a_rep = adversary(d, alice_tf, [a_mark, b_mark], write=False)
        # the 13 slabs that left her file were punched out of it; the one still bound to her (empty) keeps
        # her own stale bytes, and nothing of bob's is anywhere in her file
        assert a_rep["counts"] == {a_mark.hex(): 1 * per_block, b_mark.hex(): 0}
        assert a_rep["resident_bytes"] == gen_table + 1 * MIB
        assert bob.get_many(B_NS, b_keys) == b_blocks


def test_two_tenants_churning_through_a_small_arena_read_back_exact_bytes(tenants) -> None:
    """Bursts of one tenant, then the other, through a 16-slab arena: LRU eviction empties the other tenant's
    slabs and they move back and forth between the two files. Every get is the stored bytes or a miss."""
    tokens, alice_tf, bob_tf = tenants
    opts = dict(tokens_file=tokens, arena_bytes="16MiB", max_block_bytes="1MiB")
    sizes = [64 * 1024, 256 * 1024, MIB, 96 * 1024]

    def value(tag: bytes, i: int) -> bytes:
        return (tag + i.to_bytes(4, "little")) * (sizes[i % 4] // 8)

    with DaemonProcess(**opts) as d, Client(d.address, token_file=alice_tf) as alice, \
            Client(d.address, token_file=bob_tf) as bob:
        alice.register_namespace(A_NS)
        bob.register_namespace(B_NS)
        who = {b"AAAA": (alice, A_NS), b"BBBB": (bob, B_NS)}
        stored = {b"AAAA": 0, b"BBBB": 0}
        hits = misses = 0
        for phase in range(8):
            tag = b"AAAA" if phase % 2 == 0 else b"BBBB"
            c, ns = who[tag]
            for _ in range(20):
                i = stored[tag]
                assert c.put(ns, b"k%d" % i, value(tag, i)) is True
                stored[tag] += 1
            for t, (c2, ns2) in who.items():  # both tenants read back their recent keys
                first = max(0, stored[t] - 24)
                for j, got in zip(range(first, stored[t]), c2.get_many(ns2, [b"k%d" % j for j in range(first, stored[t])])):
                    if got is None:
                        misses += 1
                    else:
                        assert got == value(t, j), (ns2, j)
                        hits += 1
        binds = alice.stats().counters["slab_binds"]
        assert binds >= 16 + 7 * 2, binds  # after the pool's 16, every burst took slabs from the other file
        assert hits > 0 and misses > 0
        assert d.proc.poll() is None
