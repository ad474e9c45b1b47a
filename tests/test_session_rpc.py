"""The session book through a real daemon (NoteSession, ExplainSession, ListSessions; Client.note_session,
explain_session, sessions): exact entries and explanations, the bounds set on the daemon, bad input answered
with a clear error while the daemon keeps serving, an unknown session NOT_FOUND with how to fix it, and tenant
isolation (another tenant's sessions are as unknown as ones never noted)."""

from __future__ import annotations

import grpc
import pytest

from kvstore import Client
from kvstore._proto import kvstore_pb2 as pb
from kvstore.client import KeyExplanation
from kvstore.errors import (BatchTooLargeError, ConfigError, InvalidRequestError, UnknownNamespaceError,
                            UnknownSessionError)
from kvstore.server.config import ServerConfig, validate
from kvstore.testing import raw_stub
from kvstore.vocab import Tier
from tests.tenant_helpers import A_NS, B_NS, two_tenant_daemon

pytestmark = pytest.mark.timeout(90)
TP0, TP1 = "sess/tp0", "sess/tp1"
RAM, NEVER = KeyExplanation(Tier.RAM), KeyExplanation(Tier.NONE, "never_stored")


def test_a_session_in_two_shard_namespaces_is_explained_per_namespace(make_daemon) -> None:
    d = make_daemon(arena_bytes="16MiB", max_block_bytes="1MiB", disk_bytes=0)
    with d.client() as c:
        for n in (TP0, TP1):
            c.register_namespace(n)
        c.put_many(TP0, [b"k0", b"k1"], [b"x"] * 2)
        c.put(TP1, b"k0", b"y")
        assert c.note_session(TP0, "agent", [b"k0", b"k1", b"k2"]) is True
        assert c.note_session(TP1, "agent", [b"k0", b"k1", b"k2"]) is True
        tp1, tp0 = c.explain_session("agent")                       # most recently noted first
        held_by_tp0 = KeyExplanation(Tier.NONE, "other_namespace", 0.0, "", (TP0,))   # k1: only tp0 has it
        assert (tp1.namespace, tp1.keys, tp1.explanations, tp1.ended) == (TP1, (b"k0", b"k1", b"k2"),
                                                                         (RAM, held_by_tp0, NEVER), False)
        assert (tp0.namespace, tp0.explanations) == (TP0, (RAM, RAM, NEVER))
        assert [e.namespace for e in c.explain_session("agent", TP0)] == [TP0]
        # the session ends in one shard: that entry alone is marked, its chain kept
        assert c.note_session(TP0, "agent", [], ended=True) is True
        assert [(e.namespace, e.ended, len(e.keys)) for e in c.explain_session("agent")] == [(TP0, True, 3),
                                                                                             (TP1, False, 3)]
        # a new chain replaces the old one
        c.note_session(TP1, "agent", [b"k0"])
        assert c.explain_session("agent", TP1)[0].keys == (b"k0",)
        infos, total = c.sessions()
        assert total == 2 and [(i.session, i.namespace, i.blocks, i.ended) for i in infos] == [
            ("agent", TP1, 1, False), ("agent", TP0, 3, True)]
        assert [i.namespace for i in c.sessions(limit=1)[0]] == [TP1] and c.sessions(limit=1)[1] == 2
        # read-only: explaining counted no lookup
        assert {n.name: n.lookup_keys for n in c.stats().namespaces} == {TP0: 0, TP1: 0}


def test_the_daemon_bounds_its_book(make_daemon) -> None:
    d = make_daemon(arena_bytes="16MiB", max_block_bytes="1MiB", disk_bytes=0, session_book_max=2,
                    session_book_keys=5)
    with d.client() as c:
        c.register_namespace(TP0)
        for s in ("s1", "s2", "s3"):
            c.note_session(TP0, s, [s.encode()])
        assert [i.session for i in c.sessions()[0]] == ["s3", "s2"]   # s1, the oldest, forgotten
        r = c._rpc.call("NoteSession", pb.NoteSessionRequest(namespace=TP0, session="long",
                                                             keys=[b"%d" % i for i in range(8)]))
        assert (r.known, r.kept) == (True, 5)                         # the chain's head, at most 5 keys
        assert c.explain_session("long")[0].keys == (b"0", b"1", b"2", b"3", b"4")
        assert [i.session for i in c.sessions()[0]] == ["long"]      # 5 keys: nothing else fits
        assert c._rpc.call("ListSessions", pb.ListSessionsRequest()).max_sessions == 2
        # ending a forgotten session records nothing
        assert c.note_session(TP0, "s1", [], ended=True) is False


def test_bad_input_gets_a_clear_error_and_the_daemon_keeps_serving(make_daemon) -> None:
    d = make_daemon(arena_bytes="16MiB", max_block_bytes="1MiB", disk_bytes=0, max_batch_keys=4)
    with d.client() as c:
        c.register_namespace(TP0)
        with pytest.raises(InvalidRequestError, match="empty session: name the session"):
            c.note_session(TP0, "", [b"k"])
        with pytest.raises(InvalidRequestError, match="use 1..256 printable characters"):
            c.note_session(TP0, "s\n", [b"k"])
        with pytest.raises(InvalidRequestError, match="needs keys .* or ended=true"):
            c.note_session(TP0, "s", [])
        with pytest.raises(InvalidRequestError, match=r"^key 1 has 0 bytes: keys must be 1\.\.64 bytes$"):
            c.note_session(TP0, "s", [b"k", b""])
        with pytest.raises(BatchTooLargeError, match="exceeds max_batch_keys=4: note the chain's head"):
            c.note_session(TP0, "s", [b"a", b"b", b"c", b"d", b"e"])   # refused by the client
        with pytest.raises(BatchTooLargeError, match="5 keys in one session note exceeds max_batch_keys=4: note"):
            c._rpc.call("NoteSession", pb.NoteSessionRequest(namespace=TP0, session="s",   # and by the daemon
                                                             keys=[b"a", b"b", b"c", b"d", b"e"]))
        with pytest.raises(UnknownNamespaceError, match="unknown namespace 'sess/none'"):
            c.note_session("sess/none", "s", [b"k"])
        with pytest.raises(InvalidRequestError, match="invalid namespace 'bad name'"):
            c.note_session("bad name", "s", [b"k"])
        with pytest.raises(InvalidRequestError, match="empty session"):
            c.explain_session("")
        assert c.sessions() == ([], 0)                                # nothing was recorded
        c.note_session(TP0, "s", [b"k"])
        with pytest.raises(UnknownNamespaceError, match="unknown namespace 'sess/none'"):
            c.explain_session("s", "sess/none")
        assert [e.explanations for e in c.explain_session("s")] == [(NEVER,)]
        assert c.health().status == "SERVING"


def test_an_unknown_session_is_not_found_with_how_to_fix_it(make_daemon) -> None:
    d = make_daemon(arena_bytes="16MiB", max_block_bytes="1MiB", disk_bytes=0)
    with d.client() as c:
        c.register_namespace(TP0)
        c.register_namespace(TP1)
        c.note_session(TP0, "known", [b"k"])
        with pytest.raises(UnknownSessionError) as err:  # the exact class on the client, from the wire reason
            c.explain_session("nobody")
        assert str(err.value) == (
            "no session 'nobody' in the daemon's session book: a session is noted when a request carrying "
            "kv_transfer_params {'kvstore_session': 'nobody'} finishes (the vLLM connector notes it), or by "
            "Client.note_session; the book keeps the latest session_book_max, so an old one may be forgotten. "
            "`kvstore sessions` lists what it holds")
        with pytest.raises(UnknownSessionError, match="no session 'known' in namespace 'sess/tp1'"):
            c.explain_session("known", TP1)
    channel, stub = raw_stub(d.address)  # the status and reason on the wire
    with pytest.raises(grpc.RpcError) as raw:
        stub.ExplainSession(pb.ExplainSessionRequest(session="nobody"), timeout=10)
    assert raw.value.code() == grpc.StatusCode.NOT_FOUND
    assert ("kvstore-reason", "unknown_session") in tuple(raw.value.trailing_metadata() or ())
    channel.close()


def test_bad_book_settings_stop_the_daemon_before_it_starts() -> None:
    with pytest.raises(ConfigError, match="session_book_max=-1: use 0..1048576"):
        validate(ServerConfig(session_book_max=-1))
    with pytest.raises(ConfigError, match="session_book_keys=0: use 1..16777216"):
        validate(ServerConfig(session_book_keys=0))


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory):
    yield from two_tenant_daemon(tmp_path_factory.mktemp("tokens"))


def test_a_tenant_sees_only_its_own_sessions(tenants) -> None:
    daemon, alice_file, bob_file = tenants
    with Client(daemon.address, token_file=alice_file) as alice, Client(daemon.address, token_file=bob_file) as bob:
        alice.register_namespace(A_NS)
        bob.register_namespace(B_NS)
        alice.note_session(A_NS, "shared-id", [b"a"])
        bob.note_session(B_NS, "shared-id", [b"b"])
        assert [(e.namespace, e.keys) for e in alice.explain_session("shared-id")] == [(A_NS, (b"a",))]
        assert [(e.namespace, e.keys) for e in bob.explain_session("shared-id")] == [(B_NS, (b"b",))]
        alice.note_session(A_NS, "alice-only", [b"a"])
        with pytest.raises(UnknownSessionError, match="no session 'alice-only' in the daemon's session book"):
            bob.explain_session("alice-only")
        with pytest.raises(UnknownNamespaceError, match="unknown namespace 'model@abc/alice'"):
            bob.note_session(A_NS, "x", [b"k"])
        with pytest.raises(UnknownNamespaceError, match="unknown namespace 'model@abc/alice'"):
            bob.explain_session("alice-only", A_NS)
        assert [(i.session, i.namespace) for i in bob.sessions()[0]] == [("shared-id", B_NS)]
        assert bob.sessions()[1] == 1
