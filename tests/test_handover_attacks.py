"""The hand-over socket under attack, and successors the running daemon must not hand its files to.

- a tenant (same user, its own token) dials <unix_socket>.handover to claim the memory files: refused at the
  challenge, no descriptor sent, the daemon serves on (today's arena socket hands a tenant only its own file;
  this one hands no tenant any); malformed and out-of-order messages likewise; a process of another user cannot
  even connect;
- the positive control: a caller that proves it holds the whole tokens file gets the OFFER with the files;
- a successor of another hand-over format: the running daemon stops as on SIGTERM, saying why, and the
  successor starts cold; a successor with another arena geometry: the same, from the successor's side;
- a block whose bytes changed after they were hashed: the successor drops and counts it, never serves it.
"""

from __future__ import annotations

import mmap
import os
import socket

from kvstore.arena.journal import RamJournal
from kvstore.arena.layout import ArenaLayout
from kvstore.server.handover import protocol as hp
from kvstore.server.handover.auth import handover_key, proof
from kvstore.server.handover.protocol import Kind
from kvstore.testing import DaemonProcess, wait_until

NS = "alice@1/secret"
BLOCK = 16 * 1024


def _tokens(tmp_path) -> tuple[str, str, str]:
    tokens = tmp_path / "tokens"
    tokens.write_text("alice alice-token-0123456789\nmallory mallory-token-012345678\n")
    tokens.chmod(0o600)
    alice, mallory = tmp_path / "alice", tmp_path / "mallory"
    alice.write_text("alice-token-0123456789\n")
    mallory.write_text("mallory-token-012345678\n")
    for f in (alice, mallory):
        f.chmod(0o600)
    return str(tokens), str(alice), str(mallory)


def _dial(d: DaemonProcess) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(d.socket_path + ".handover")
    return s


def _challenge(s: socket.socket) -> bytes:
    hp.send(s, Kind.HELLO, {"version": "attacker", "pid": os.getpid()})
    msg = hp.recv(s)
    assert msg.kind == Kind.CHALLENGE and msg.fds == []
    return bytes.fromhex(msg.body["nonce"])


def _answer(s: socket.socket) -> hp.Message | None:
    try:
        return hp.recv(s)
    except hp.HandoverError:
        return None


def test_a_tenant_cannot_claim_the_memory_files(tmp_path) -> None:
    tokens, alice, mallory = _tokens(tmp_path)
    with DaemonProcess(arena_bytes="32MiB", max_block_bytes="1MiB", tokens_file=tokens) as d:
        with d.client(token_file=alice) as a:
            a.register_namespace(NS)
            assert a.put(NS, b"k", b"\x42" * BLOCK) is True
        attempts = []
        # 1. mallory answers with her own token as the key
        s = _dial(d)
        nonce = _challenge(s)
        import hashlib
        hp.send(s, Kind.PROOF, {"hmac": proof(hashlib.sha256(b"mallory-token-012345678").digest(), nonce)})
        attempts.append(_answer(s))
        s.close()
        # 2. a proof as if the daemon had no tokens
        s = _dial(d)
        nonce = _challenge(s)
        hp.send(s, Kind.PROOF, {"hmac": proof(handover_key(""), nonce)})
        attempts.append(_answer(s))
        s.close()
        # 3. skipping the proof: straight to ACCEPT
        s = _dial(d)
        _challenge(s)
        hp.send(s, Kind.ACCEPT, {})
        attempts.append(_answer(s))
        s.close()
        # 4. garbage instead of HELLO
        s = _dial(d)
        s.sendall(os.urandom(64))
        attempts.append(_answer(s))
        s.close()
        for got in attempts:  # an ERROR or a closed connection: never an OFFER, never a descriptor
            assert got is None or (got.kind == Kind.ERROR and got.fds == [])
        assert d.log().count("refused a hand-over") == 4
        with d.client(token_file=alice) as a:  # the daemon serves on, alice's bytes untouched
            assert a.get(NS, b"k") == b"\x42" * BLOCK
            assert a.health().pid == d.proc.pid  # type: ignore[union-attr]


def test_another_user_cannot_even_connect(tmp_path) -> None:
    if os.getuid() != 0:  # only root can make a process of another user here
        return
    with DaemonProcess(arena_bytes="32MiB", max_block_bytes="1MiB") as d:
        pid = os.fork()
        if pid == 0:  # the child: user nobody dials the socket
            code = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(d.socket_path + ".handover")
                except PermissionError:
                    code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0  # refused by the 0700 directory and the 0600 socket


def test_whoever_holds_the_tokens_file_gets_the_files(tmp_path) -> None:
    # the positive control of the test above: the same dial with the right proof gets the OFFER and the files
    tokens, alice, _ = _tokens(tmp_path)
    with DaemonProcess(arena_bytes="32MiB", max_block_bytes="1MiB", tokens_file=tokens) as d:
        with d.client(token_file=alice) as a:
            a.register_namespace(NS)
            assert a.put(NS, b"k", b"\x42" * BLOCK) is True
        s = _dial(d)
        nonce = _challenge(s)
        hp.send(s, Kind.PROOF, {"hmac": proof(handover_key(tokens), nonce)})
        offer = hp.recv(s)
        try:
            assert offer.kind == Kind.OFFER
            names = [tuple(n) for n in offer.body["files"]]
            assert names[0] == ("journal", "") and ("arena", "alice") in names and len(offer.fds) == len(names)
        finally:
            offer.close_fds()
            s.close()  # no ACCEPT: the daemon never stopped serving
        wait_until(lambda: "stopped before its window" in d.log(), 10, what="the session's end")
        with d.client(token_file=alice) as a:
            assert a.get(NS, b"k") == b"\x42" * BLOCK


def test_a_successor_of_another_format_makes_the_daemon_stop_for_a_cold_start(tmp_path) -> None:
    d = DaemonProcess(workdir=str(tmp_path), arena_bytes="32MiB", max_block_bytes="1MiB")
    d.start()
    try:
        s = _dial(d)
        hp.send(s, Kind.HELLO, {"version": "9.9", "pid": os.getpid()}, fmt=hp.FORMAT + 1)
        msg = hp.recv(s)
        assert msg.kind == Kind.CHALLENGE
        hp.send(s, Kind.PROOF, {"hmac": proof(handover_key(""), bytes.fromhex(msg.body["nonce"]))},
                fmt=hp.FORMAT + 1)
        declined = hp.recv(s)
        assert declined.kind == Kind.DECLINE and declined.fds == []
        assert f"speaks hand-over format {hp.FORMAT + 1}" in declined.body["why"]
        assert d.proc is not None and d.proc.wait(30) == 0  # it stopped as on SIGTERM
        assert s.recv(1) == b""  # its end closed when the process exited: what the successor waits for
        s.close()
        assert "stopping as on SIGTERM so that the successor starts cold" in d.log()
    finally:
        d.close()


def test_a_successor_with_another_arena_starts_cold_and_says_why(tmp_path) -> None:
    d = DaemonProcess(workdir=str(tmp_path), arena_bytes="32MiB", max_block_bytes="1MiB", disk_bytes="64MiB",
                      disk_segment_bytes="16MiB", disk_write="commit")
    d.start()
    try:
        with d.client() as c:
            c.register_namespace("m@1/x")
            assert c.put("m@1/x", b"k", b"\x07" * BLOCK) is True
            wait_until(lambda: c.stats().disk.blocks == 1, 20, what="the disk write")
        s = d.successor(extra_args=["--arena-bytes", "64MiB"])
        try:
            assert d.proc is not None and d.proc.returncode == 0
            log = s.log()
            assert "take-over: starting cold: the running daemon's arena is 32 slabs of 1048576 bytes, this " \
                   "one's 64 of 1048576 (arena_bytes or max_block_bytes changed)" in log
            with s.client() as c:  # cold RAM; the disk tier still has the block
                assert c.get("m@1/x", b"k") == b"\x07" * BLOCK
        finally:
            s.close()
    finally:
        d.close()


def test_a_block_damaged_before_the_hand_over_is_dropped_and_counted_never_served(tmp_path) -> None:
    # the attacker is a caller that passed the check (no tokens: this user): it takes the files, lets the daemon
    # hash every block (PREPARED), goes away, and changes one block's bytes; the real successor must not serve it
    d = DaemonProcess(workdir=str(tmp_path), arena_bytes="32MiB", max_block_bytes="1MiB")
    d.start()
    try:
        keys = [b"d-%d" % i for i in range(10)]
        values = [bytes([i + 1]) * BLOCK for i in range(10)]
        with d.client() as c:
            c.register_namespace("m@1/x")
            assert c.put_many("m@1/x", keys, values).stored == 10
        s = _dial(d)
        nonce = _challenge(s)
        hp.send(s, Kind.PROOF, {"hmac": proof(handover_key(""), nonce)})
        offer = hp.recv(s)
        assert offer.kind == Kind.OFFER
        names = [tuple(n) for n in offer.body["files"]]
        hp.send(s, Kind.ACCEPT, {})
        assert hp.recv(s).kind == Kind.PREPARED  # every block's record written and hashed
        s.close()  # gone before the window: the daemon serves on
        layout = ArenaLayout.for_capacity(d.arena_name.lstrip("/"), 32 << 20, 1 << 20)
        journal = RamJournal.open(os.dup(offer.fds[names.index(("journal", ""))]), layout)
        scan = journal.scan()
        offset = int(scan.records["offset"][scan.keys().index(keys[3])])
        journal.close()
        with mmap.mmap(offer.fds[names.index(("arena", ""))], layout.size_bytes) as m:
            m[offset + 100] ^= 0x01
        offer.close_fds()
        succ = d.successor()
        try:
            with succ.client() as c:
                got = c.get_many("m@1/x", keys)
                counters = c.stats().counters
            assert got[3] is None and got[:3] + got[4:] == values[:3] + values[4:]
            assert (counters["restart_adopted_blocks"], counters["restart_dropped_checksum"]) == (9, 1)
            assert "dropped: checksum 1" in succ.log()
        finally:
            succ.close()
    finally:
        d.close()
