"""Bearer tokens and tenant isolation, walked through every RPC of the proto with a foreign token, and the CLI.

Foreign namespaces, reservations and leases get the answers of things that do not exist (NOT_FOUND with the
same message as a never-registered name; a foreign lease is simply not released), so a token cannot probe
another tenant. RegisterNamespace of a taken name is the one PERMISSION_DENIED (see server/tenancy.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import grpc
import pytest

from kvstore.engine.claims import CLAIMED

from kvstore import Client, ConfigError, PermissionDeniedError, UnauthenticatedError
from kvstore._proto import kvstore_pb2 as pb
from kvstore.server.config import load_config
from kvstore.testing import DaemonProcess, raw_stub
from tests.tenant_helpers import A_NS, ALICE_TOKEN, B_NS, BOB_TOKEN, secret

C = grpc.StatusCode


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("tokens")
    tokens = secret(str(d / "tokens"), f"# tenant token\nalice {ALICE_TOKEN}\nbob   {BOB_TOKEN}  # bob's\n")
    alice = secret(str(d / "alice.token"), ALICE_TOKEN + "\n")
    bob = secret(str(d / "bob.token"), f"bob {BOB_TOKEN}\n")  # a line of the daemon's file works too
    with DaemonProcess(tokens_file=tokens, disk_bytes="8MiB", disk_segment_bytes="4MiB") as daemon:
        yield daemon, alice, bob


def _md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", "Bearer " + token),)


def _status(fn) -> tuple[grpc.StatusCode, str, str]:
    try:
        fn()
    except grpc.RpcError as err:
        return err.code(), dict(err.trailing_metadata() or ()).get("kvstore-reason", ""), err.details()
    return C.OK, "", ""


def test_tokens_file_must_be_owner_only_and_well_formed(tmp_path) -> None:
    p = tmp_path / "tokens"
    p.write_text(f"alice {ALICE_TOKEN}\n")
    os.chmod(p, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_config(["--tokens-file", str(p)], env={})
    os.chmod(p, 0o600)
    load_config(["--tokens-file", str(p)], env={})
    p.write_text("alice short\n")
    with pytest.raises(ConfigError, match="at least 16"):
        load_config(["--tokens-file", str(p)], env={})
    p.write_text(f"alice {ALICE_TOKEN}\nbob {ALICE_TOKEN}\n")
    with pytest.raises(ConfigError, match="same token"):
        load_config(["--tokens-file", str(p)], env={})


def test_every_rpc_needs_a_valid_token(tenants) -> None:
    daemon, _, _ = tenants
    ch, stub = raw_stub(daemon.address)
    try:
        for md, why in (((), "missing bearer token"), (_md("not-a-real-token-at-all"), "invalid bearer token"),
                        ((("authorization", "Basic abc"),), "malformed authorization")):
            for name, req in (("Health", pb.HealthRequest()), ("Stats", pb.StatsRequest()),
                              ("Lookup", pb.LookupRequest(namespace=A_NS, keys=[b"k"]))):
                code, reason, details = _status(lambda: getattr(stub, name)(req, timeout=5, metadata=md))
                assert (code, reason) == (C.UNAUTHENTICATED, "unauthenticated") and why in details, (name, details)
            code, reason, _ = _status(lambda: list(stub.Get(pb.KeysRequest(namespace=A_NS, keys=[b"k"]),
                                                            timeout=5, metadata=md)))
            assert code == C.UNAUTHENTICATED
            code, _, _ = _status(lambda: stub.Put(iter([]), timeout=5, metadata=md))
            assert code == C.UNAUTHENTICATED
    finally:
        ch.close()
    with pytest.raises(UnauthenticatedError, match="missing bearer token"):
        Client(daemon.address, token_file="")


def test_foreign_token_is_refused_on_every_rpc(tenants) -> None:
    daemon, alice_file, bob_file = tenants
    alice = Client(daemon.address, token_file=alice_file, mode="stream")
    bob = Client(daemon.address, token_file=bob_file)
    alice.register_namespace(A_NS, model="model", layout_digest="abc")
    bob.register_namespace(B_NS, model="model", layout_digest="abc")
    assert alice.put(A_NS, b"k0", b"alice's secret" * 100)
    assert alice.put(A_NS, b"k1", b"more" * 100)
    alice.pin(A_NS, [b"k1"])
    assert alice.note_session(A_NS, "alice-s", [b"k0", b"k1"])
    ch, stub = raw_stub(daemon.address)
    a_md, b_md = _md(ALICE_TOKEN), _md(BOB_TOKEN)
    rid = stub.Reserve(pb.ReserveRequest(namespace=A_NS, keys=[b"r"], sizes=[100]), metadata=a_md).reservation_id
    lease = stub.Lookup(pb.LookupRequest(namespace=A_NS, keys=[b"k0"], lease=True), metadata=a_md).lease_id
    assert rid and lease
    keys = pb.KeysRequest(namespace=A_NS, keys=[b"k0", b"k1"])
    unknown = "unknown namespace 'model@abc/alice': register it first"
    # method -> (call with bob's token, expected code, reason, text in the message)
    cases = {
        "Health": (lambda: stub.Health(pb.HealthRequest(), metadata=b_md), C.OK, "", ""),
        "RegisterNamespace": (lambda: stub.RegisterNamespace(pb.RegisterNamespaceRequest(
            name=A_NS, model="model", layout_digest="abc"), metadata=b_md), C.PERMISSION_DENIED, "permission_denied",
            "taken by another tenant"),
        "Reserve": (lambda: stub.Reserve(pb.ReserveRequest(namespace=A_NS, keys=[b"x"], sizes=[1]), metadata=b_md),
                    C.NOT_FOUND, "unknown_namespace", unknown),
        "Commit": (lambda: stub.Commit(pb.CommitRequest(reservation_id=rid), metadata=b_md), C.NOT_FOUND,
                   "unknown_reservation", f"reservation {rid} is unknown"),
        "Abort": (lambda: stub.Abort(pb.AbortRequest(reservation_id=rid), metadata=b_md), C.NOT_FOUND,
                  "unknown_reservation", f"reservation {rid} is unknown"),
        "Lookup": (lambda: stub.Lookup(pb.LookupRequest(namespace=A_NS, keys=[b"k0"], lease=True), metadata=b_md),
                   C.NOT_FOUND, "unknown_namespace", unknown),
        "Release": (lambda: _released_none(stub.Release(pb.ReleaseRequest(lease_ids=[lease]), metadata=b_md)),
                    C.OK, "", ""),
        "Exists": (lambda: stub.Exists(keys, metadata=b_md), C.NOT_FOUND, "unknown_namespace", unknown),
        "Claim": (lambda: stub.Claim(pb.ClaimRequest(namespaces=[A_NS], keys=[b"c"], claimant=b"bob", ttl_ms=60_000),
                                     metadata=b_md), C.NOT_FOUND, "unknown_namespace", unknown),
        "Delete": (lambda: stub.Delete(keys, metadata=b_md), C.NOT_FOUND, "unknown_namespace", unknown),
        "Pin": (lambda: stub.Pin(keys, metadata=b_md), C.NOT_FOUND, "unknown_namespace", unknown),
        "Unpin": (lambda: stub.Unpin(keys, metadata=b_md), C.NOT_FOUND, "unknown_namespace", unknown),
        "Stats": (lambda: _no_foreign(stub.Stats(pb.StatsRequest(), metadata=b_md)), C.OK, "", ""),
        "ListKeys": (lambda: stub.ListKeys(pb.ListKeysRequest(namespace=A_NS), metadata=b_md), C.NOT_FOUND,
                     "unknown_namespace", unknown),
        "Describe": (lambda: stub.Describe(keys, metadata=b_md), C.NOT_FOUND, "unknown_namespace", unknown),
        "Explain": (lambda: stub.Explain(keys, metadata=b_md), C.NOT_FOUND, "unknown_namespace", unknown),
        "Hint": (lambda: stub.Hint(pb.HintRequest(namespace=A_NS, keys=[b"k0", b"k1"], action="pin", ttl_s=60),
                                   metadata=b_md), C.NOT_FOUND, "unknown_namespace", unknown),
        "ClearNamespace": (lambda: stub.ClearNamespace(pb.ClearNamespaceRequest(namespace=A_NS), metadata=b_md),
                           C.NOT_FOUND, "unknown_namespace", unknown),
        "Put": (lambda: stub.Put(iter([pb.PutChunk(header=pb.BlockHeader(namespace=A_NS, key=b"p", size=3)),
                                       pb.PutChunk(data=b"abc")]), metadata=b_md),
                C.NOT_FOUND, "unknown_namespace", unknown),
        "Get": (lambda: list(stub.Get(keys, metadata=b_md)), C.NOT_FOUND, "unknown_namespace", unknown),
        "NoteSession": (lambda: stub.NoteSession(pb.NoteSessionRequest(namespace=A_NS, session="alice-s",
                                                                       keys=[b"k0"]), metadata=b_md),
                        C.NOT_FOUND, "unknown_namespace", unknown),
        "ExplainSession": (lambda: stub.ExplainSession(pb.ExplainSessionRequest(session="alice-s"), metadata=b_md),
                           C.NOT_FOUND, "unknown_session", "no session 'alice-s' in the daemon's session book"),
        "ListSessions": (lambda: _no_sessions(stub.ListSessions(pb.ListSessionsRequest(), metadata=b_md)), C.OK, "",
                         ""),
        "Subscribe": (lambda: next(iter(stub.Subscribe(pb.SubscribeRequest(namespaces=[A_NS]), metadata=b_md))),
                      C.NOT_FOUND, "unknown_namespace", unknown),
        "Annotate": (lambda: stub.Annotate(pb.AnnotateRequest(namespace=A_NS, keys=[b"k0"], block_size=4, origins=[
            pb.BlockOrigin(block_hashes=[b"h" * 32])]), metadata=b_md), C.NOT_FOUND, "unknown_namespace", unknown),
        "PrefixScore": (lambda: stub.PrefixScore(keys, metadata=b_md), C.NOT_FOUND, "unknown_namespace", unknown),
    }
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods}
    assert set(cases) == methods, f"walk every RPC: missing {methods - set(cases)}"
    try:
        for name, (call, code, reason, text) in cases.items():
            got = _status(call)
            assert got[0] == code and got[1] == reason and text in got[2], (name, got)
        # the same answer as a name nobody registered: existence does not leak
        never = _status(lambda: stub.Exists(pb.KeysRequest(namespace="model@abc/nobody", keys=[b"k"]), metadata=b_md))
        assert never[:2] == (C.NOT_FOUND, "unknown_namespace") and "register it first" in never[2]
        # a token cannot register for someone else
        got = _status(lambda: stub.RegisterNamespace(pb.RegisterNamespaceRequest(name="model@abc/bob2", tenant="alice"),
                                                     metadata=b_md))
        assert got[:2] == (C.PERMISSION_DENIED, "permission_denied")
        # alice's world is untouched: her reservation commits, her lease is still held, her data and pin remain
        stub.Commit(pb.CommitRequest(reservation_id=rid), metadata=a_md)
        assert stub.Release(pb.ReleaseRequest(lease_ids=[lease]), metadata=a_md).released == 1
        assert alice.get(A_NS, b"k0") == b"alice's secret" * 100
        assert [k.pins for k in alice.describe(A_NS, [b"k0", b"k1"])] == [0, 1]  # bob's Hint pinned nothing
        assert alice.claim([A_NS], [b"c"], b"alice", 1000) == [CLAIMED]           # bob's Claim recorded nothing
        assert {n.name for n in alice.stats().namespaces} == {A_NS}
        # bob's NoteSession recorded nothing: alice's session still holds her two keys
        assert [(e.session, e.namespace, list(e.keys)) for e in alice.explain_session("alice-s")] == [
            ("alice-s", A_NS, [b"k0", b"k1"])]
    finally:
        ch.close()
        alice.close()
        bob.close()


def _released_none(r: pb.ReleaseResponse) -> None:
    assert r.released == 0


def _no_sessions(r: pb.ListSessionsResponse) -> None:
    assert list(r.sessions) == [] and r.total == 0  # alice's session is not bob's to see, not even counted


def _no_foreign(r: pb.StatsResponse) -> None:
    assert A_NS not in {n.name for n in r.namespaces} and B_NS in {n.name for n in r.namespaces}


def test_subscribe_delivers_only_own_events(tenants) -> None:
    daemon, alice_file, bob_file = tenants
    with Client(daemon.address, token_file=alice_file) as alice, Client(daemon.address, token_file=bob_file) as bob:
        alice.register_namespace(A_NS, model="model", layout_digest="abc")
        bob.register_namespace(B_NS, model="model", layout_digest="abc")
        got: list[str] = []
        with bob.subscribe() as events:
            def read() -> None:
                for ev in events:
                    got.append(ev.namespace)
                    if ev.namespace == B_NS:
                        return
            t = threading.Thread(target=read, daemon=True)
            t.start()
            import time
            time.sleep(0.3)
            alice.put(A_NS, b"ev-a", b"x" * 100)
            bob.put(B_NS, b"ev-b", b"y" * 100)
            t.join(10)
        assert got and set(got) == {B_NS}


def test_cli_with_tokens(tenants) -> None:
    daemon, alice_file, bob_file = tenants
    with Client(daemon.address, token_file=alice_file) as alice:
        alice.register_namespace(A_NS, model="model", layout_digest="abc")
        alice.put(A_NS, b"cli-k", b"cli bytes")

    def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvstore.cli.main", "--address", daemon.address, *args],
                              capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})
    assert cli("--token-file", alice_file, "get", A_NS, "cli-k").stdout == "cli bytes"
    assert cli("get", A_NS, "cli-k", env={"KVSTORE_TOKEN_FILE": alice_file}).stdout == "cli bytes"
    for args in (["ls", A_NS], ["show", A_NS, "cli-k"], ["get", A_NS, "cli-k"], ["delete", A_NS, "cli-k"],
                 ["pin", A_NS, "cli-k"], ["clear", A_NS, "--yes"], ["inspect", A_NS, "cli-k"]):
        r = cli("--token-file", bob_file, *args)
        assert r.returncode in (1, 2) and "cli bytes" not in r.stdout, (args, r.stdout, r.stderr)
        assert "unknown namespace" in r.stderr or r.returncode == 1, (args, r.stderr)
    r = cli("--token-file", bob_file, "--json", "stats")
    assert r.returncode == 0 and A_NS not in r.stdout
    r = cli("stats", env={"KVSTORE_TOKEN_FILE": ""})
    assert r.returncode == 2 and "missing bearer token" in r.stderr
    assert cli("--token-file", alice_file, "get", A_NS, "cli-k").stdout == "cli bytes"  # still there


def test_register_for_someone_else_via_client(tenants) -> None:
    daemon, _, bob_file = tenants
    with Client(daemon.address, token_file=bob_file) as bob:
        with pytest.raises(PermissionDeniedError, match="belongs to tenant 'bob', not 'alice'"):
            bob.register_namespace("model@abc/x", tenant="alice")


def test_namespace_owners_survive_a_restart_with_the_disk_tier(tmp_path) -> None:
    """After a restart the disk tier brings namespaces back before anyone registers them: only their old
    tenant may claim them (owners are kept in <disk_dir>.owners.json), and nobody else reads their blocks."""
    tokens = secret(str(tmp_path / "tokens"), f"alice {ALICE_TOKEN}\nbob {BOB_TOKEN}\n")
    alice_file = secret(str(tmp_path / "alice.token"), ALICE_TOKEN)
    bob_file = secret(str(tmp_path / "bob.token"), BOB_TOKEN)
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    d = DaemonProcess(workdir=str(work), tokens_file=tokens, disk_bytes="8MiB", disk_segment_bytes="4MiB")
    try:
        d.start()
        with Client(d.address, token_file=alice_file) as alice:
            alice.register_namespace(A_NS)
            alice.put(A_NS, b"persist", b"on disk" * 1000)
            import time
            deadline = time.monotonic() + 10
            while alice.describe(A_NS, [b"persist"])[0].tier != "ram+disk" and time.monotonic() < deadline:
                time.sleep(0.05)
        owners = str(work / "disk") + ".owners.json"
        assert os.stat(owners).st_mode & 0o077 == 0
        d.stop()
        d._log.close()
        d.start()
        with Client(d.address, token_file=bob_file) as bob:
            with pytest.raises(PermissionDeniedError, match="taken by another tenant"):
                bob.register_namespace(A_NS)
            with pytest.raises(Exception, match="unknown namespace"):
                bob.get(A_NS, b"persist")
        with Client(d.address, token_file=alice_file) as alice:
            assert alice.get(A_NS, b"persist") == b"on disk" * 1000  # recovered, still hers
            alice.register_namespace(A_NS)
    finally:
        d.close()
