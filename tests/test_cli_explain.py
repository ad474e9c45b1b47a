"""`kvstore explain` against one real daemon: keys from argv, --keys-file and --tokens-file (keyed like the vLLM
connector, here computed independently with kvstore_connector.keys), or a session of the daemon's session book
(--session, and `kvstore sessions`), exact rows and summary, --json, and every bad input answered with a message
and exit code 2.

Runs call `main([...])` in-process (output via capsys); each test uses its own namespace.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore_connector.keys import KeyChain, chain_root
from kvstore.cli.main import main
from kvstore.engine.misses import CAUSES
from kvstore.testing import DaemonProcess, wait_until
from kvstore.vocab import Tier
from tests.tenant_helpers import A_NS, ALICE_TOKEN, BOB_TOKEN, secret

pytestmark = pytest.mark.timeout(90)
TOKENS = list(range(1000, 1022))  # 22 tokens: 5 full blocks of 4, 2 left over
TPB = 4


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess(arena_bytes="16MiB", max_block_bytes="1MiB") as d:
        yield d


def _ns(tag: str) -> str:
    return f"explain-{tag}-{uuid.uuid4().hex[:8]}"


def _cli(daemon: DaemonProcess, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["--address", daemon.address, *args])
    out, err = capsys.readouterr()
    return rc, out, err


def _json(daemon: DaemonProcess, capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    rc, out, err = _cli(daemon, capsys, "--json", *args)
    assert rc == 0, err
    return json.loads(out)


def _keys(seed: int = 0, tokens: list[int] = TOKENS) -> list[bytes]:
    """The connector's keys, built here the way kvstore_connector/scheduler.py builds them."""
    return list(KeyChain(TPB, seed, chain_root(seed)).extend(tokens))


def _no_misses(**counts: int) -> dict[str, int]:
    return {c: counts.get(c, 0) for c in CAUSES}


def _tokens_namespace(daemon: DaemonProcess, tag: str) -> tuple[str, list[bytes]]:
    """A namespace with tokens_per_block=4 holding blocks 0, 1 and 4 of TOKENS; block 2 deleted, 3 never stored."""
    ns, keys = _ns(tag), _keys()
    with daemon.client() as c:
        c.register_namespace(ns, tokens_per_block=TPB)
        assert c.put_many(ns, [keys[i] for i in (0, 1, 2, 4)], [b"kv%d" % i for i in (0, 1, 2, 4)]).stored == 4
        assert c.delete(ns, [keys[2]]) == 1
    return ns, keys


def test_tokens_file_as_json_list_rows_and_summary(daemon: DaemonProcess, capsys, tmp_path: Path) -> None:
    ns, keys = _tokens_namespace(daemon, "tok")
    f = tmp_path / "prompt.json"
    f.write_text(json.dumps(TOKENS))
    doc = _json(daemon, capsys, "explain", ns, "--tokens-file", str(f))
    assert (doc["namespace"], doc["tokens_per_block"], doc["key_seed"]) == (ns, 4, 0)
    blocks = doc["blocks"]
    assert [b["key"] for b in blocks] == [k.hex() for k in keys]
    assert [b["index"] for b in blocks] == [0, 1, 2, 3, 4]
    assert [b["tokens"] for b in blocks] == [[0, 4], [4, 8], [8, 12], [12, 16], [16, 20]]
    assert [(b["tier"], b["cause"], b["policy"], b["other_namespaces"]) for b in blocks] == [
        ("ram", None, None, []), ("ram", None, None, []), ("none", "deleted", None, []),
        ("none", "never_stored", None, []), ("ram", None, None, [])]
    assert [b["age_s"] is None for b in blocks] == [True, True, False, True, True]
    assert 0 <= blocks[2]["age_s"] < 30
    assert doc["summary"] == {"blocks": 5, "by_tier": {"ram": 3, "disk": 0, "none": 2},
                              "misses_by_cause": _no_misses(deleted=1, never_stored=1), "prefix_blocks": 2,
                              "prefix_tokens": 8, "first_miss": {"index": 2, "cause": "deleted"}, "tail_tokens": 2}


def test_tokens_file_whitespace_separated_table_and_key_seed(daemon: DaemonProcess, capsys, tmp_path: Path) -> None:
    ns, keys = _tokens_namespace(daemon, "ws")
    f = tmp_path / "prompt.txt"
    f.write_text(" ".join(map(str, TOKENS[:10])) + "\n" + "\n".join(map(str, TOKENS[10:])) + "\n")
    rc, out, err = _cli(daemon, capsys, "explain", ns, "--tokens-file", str(f))
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[-1] == ("5 block(s): ram 3, disk 0, missing 2; misses by cause: never_stored 1, deleted 1; a prefix "
                         "Lookup hits the first 2 of 5 (8 tokens); first miss: block 2, deleted; 2 token(s) past the "
                         "last full block have no key")
    cells = [line.replace("┃", "│").split("│") for line in lines if line.startswith(("│", "┃"))]  # rich: header ┃, rows │
    rows = {c[1].strip(): [cell.strip() for cell in c[2:-1]] for c in cells}
    assert rows["#"] == ["tokens", "key", "where", "age", "other namespaces"]
    assert rows["0"] == ["0-3", keys[0].hex()[:16] + "…", "ram", "-", "-"]
    assert rows["2"][:3] == ["8-11", keys[2].hex()[:16] + "…", "deleted"] and rows["2"][3].endswith("s")
    assert rows["3"] == ["12-15", keys[3].hex()[:16] + "…", "never_stored", "-", "-"]
    # another key_seed is another key space: nothing of it was stored
    doc = _json(daemon, capsys, "explain", ns, "--tokens-file", str(f), "--key-seed", "7")
    assert [b["key"] for b in doc["blocks"]] == [k.hex() for k in _keys(7)] != [k.hex() for k in keys]
    assert doc["key_seed"] == 7 and doc["summary"]["misses_by_cause"] == _no_misses(never_stored=5)
    assert doc["summary"]["prefix_blocks"] == 0 and doc["summary"]["first_miss"] == {"index": 0,
                                                                                    "cause": "never_stored"}


def test_keys_file_and_hex_arguments(daemon: DaemonProcess, capsys, tmp_path: Path) -> None:
    ns, other = _ns("keys"), _ns("other")
    with daemon.client() as c:
        c.register_namespace(ns)
        c.register_namespace(other)
        c.put_many(ns, [b"\x01\x02", b"\x03\x04"], [b"a", b"b"])
        c.put(other, b"\xaa\xbb", b"c")
        assert c.clear(ns) == 2
        c.put(ns, b"\x03\x04", b"b")
    f = tmp_path / "keys.txt"
    f.write_text("0102\n\n0304\r\nhex:aabb\n")
    doc = _json(daemon, capsys, "explain", ns, "--keys-file", str(f))
    assert (doc["tokens_per_block"], doc["key_seed"]) == (None, None)
    assert [(b["key"], b["tier"], b["cause"], b["other_namespaces"]) for b in doc["blocks"]] == [
        ("0102", "none", "cleared", []), ("0304", "ram", None, []), ("aabb", "none", "cleared", [other])]
    assert "tokens" not in doc["blocks"][0] and doc["summary"]["prefix_tokens"] is None
    assert doc["summary"]["misses_by_cause"] == _no_misses(cleared=2)
    rc, out, _ = _cli(daemon, capsys, "explain", ns, "0304", "aabb")
    assert rc == 0 and out.splitlines()[-1] == ("2 block(s): ram 1, disk 0, missing 1; misses by cause: cleared 1; "
                                                "a prefix Lookup hits the first 1 of 2; first miss: block 1, cleared")
    rc, out, _ = _cli(daemon, capsys, "explain", ns, "0304")
    assert rc == 0 and out.splitlines()[-1].endswith("a prefix Lookup hits the first 1 of 1; no miss")


@pytest.mark.parametrize("setup, args, message", [
    ("", ["explain", "explain-nobody", "0102"], "unknown namespace 'explain-nobody': register it first"),
    ("", ["explain", "explain-nobody", "--tokens-file", "{tokens}"],
     "unknown namespace 'explain-nobody': register it first"),
    ("plain", ["explain", "{ns}", "--tokens-file", "{tokens}"], "was registered without tokens_per_block"),
    ("plain", ["explain", "{ns}", "--keys-file", "{badhex}"], "badhex.txt:2: 'xyz' is not a hex key"),
    ("plain", ["explain", "{ns}", "--keys-file", "{empty}"], "empty.txt holds no keys"),
    ("plain", ["explain", "{ns}", "--keys-file", "{missing}"], "cannot read"),
    ("tpb", ["explain", "{ns}", "--tokens-file", "{empty}"], "empty.txt holds no token ids"),
    ("tpb", ["explain", "{ns}", "--tokens-file", "{words}"], "words.txt: token 1 is 'two': token ids are integers"),
    ("tpb", ["explain", "{ns}", "--tokens-file", "{floats}"], "floats.json: token 1 is 2.5: token ids are integers"),
    ("tpb", ["explain", "{ns}", "--tokens-file", "{negative}"], "negative.txt: token 0 is '-1'"),
    ("tpb", ["explain", "{ns}", "--tokens-file", "{badjson}"], "badjson.json: not a JSON list of token ids"),
    ("tpb", ["explain", "{ns}", "--tokens-file", "{short}"], "3 token(s) make no full block of 4 tokens"),
    ("tpb", ["explain", "{ns}"], "give exactly one of KEY_HEX..., --keys-file F or --tokens-file F (got none)"),
    ("tpb", ["explain", "{ns}", "0102", "--tokens-file", "{tokens}"], "(got KEY_HEX and --tokens-file)"),
])
def test_bad_input_is_a_clear_error_and_exit_code_2(daemon: DaemonProcess, capsys, tmp_path: Path, setup: str,
                                                     args: list[str], message: str) -> None:
    ns = _ns("bad")
    if setup:
        with daemon.client() as c:
            c.register_namespace(ns, tokens_per_block=TPB if setup == "tpb" else None)
    files = {"tokens": "1 2 3 4 5", "badhex": "0102\nxyz\n", "empty": "\n \n", "words": "1 two 3",
             "floats": "[1, 2.5]", "negative": "-1 2", "badjson": "[1, 2", "short": "[1, 2, 3]"}
    paths = {name: tmp_path / f"{name}.{'json' if name in ('floats', 'badjson') else 'txt'}" for name in files}
    for name, text in files.items():
        paths[name].write_text(text)
    fmt = {**{n: str(p) for n, p in paths.items()}, "ns": ns, "missing": str(tmp_path / "nope.txt")}
    rc, out, err = _cli(daemon, capsys, *[a.format(**fmt) for a in args])
    assert (rc, out) == (2, "") and err.startswith("kvstore: error: ") and message in err, err


def test_bad_hex_argument_is_a_usage_error(daemon: DaemonProcess, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--address", daemon.address, "explain", "ns", "0g"])
    assert exc.value.code == 2
    assert "'0g' is not a hex key: give an even number of hex digits" in capsys.readouterr().err


def test_another_tenants_namespace_is_unknown_to_the_cli(tmp_path: Path, capsys) -> None:
    tokens = secret(str(tmp_path / "tokens"), f"alice {ALICE_TOKEN}\nbob {BOB_TOKEN}\n")
    alice = secret(str(tmp_path / "alice.token"), ALICE_TOKEN + "\n")
    bob = secret(str(tmp_path / "bob.token"), BOB_TOKEN + "\n")
    f = tmp_path / "prompt.txt"
    f.write_text(" ".join(map(str, TOKENS)))
    with DaemonProcess(tokens_file=tokens) as d:
        with d.client(token_file=alice) as c:
            c.register_namespace(A_NS, tokens_per_block=TPB)
            c.put(A_NS, _keys()[0], b"kv")
        unknown = f"unknown namespace {A_NS!r}: register it first"
        for args in (["0102"], ["--tokens-file", str(f)]):
            capsys.readouterr()
            assert main(["--address", d.address, "--token-file", bob, "explain", A_NS, *args]) == 2
            assert unknown in capsys.readouterr().err
        capsys.readouterr()
        assert main(["--address", d.address, "--token-file", alice, "--json", "explain", A_NS,
                     "--tokens-file", str(f)]) == 0
        assert json.loads(capsys.readouterr().out)["summary"]["prefix_blocks"] == 1


# -- --session: the daemon's session book ------------------------------------------------------------------------
SESSION_TOKENS = list(range(2000, 2024))  # 24 tokens: 6 full blocks of 4
BLOCK = b"v" * (1 << 20)


@pytest.fixture(scope="module")
def tiered() -> Iterator[DaemonProcess]:
    """4 RAM slots of 1 MiB, a disk tier that admits a block only once it was used twice (seen:2), so a block
    put once and evicted has no disk copy: it is gone ("evicted"), while a demoted one lives on disk."""
    with DaemonProcess(arena_bytes="4MiB", max_block_bytes="1MiB", high_watermark=1.0, low_watermark=1.0,
                       disk_bytes="16MiB", disk_segment_bytes="4MiB", disk_sync="none",
                       disk_admission="seen:2") as d:
        yield d


def _session_walk(d: DaemonProcess) -> tuple[str, list[bytes]]:
    """Session "walk" noted with 6 blocks: 0 on disk (demoted), 1 and 2 evicted by lru, 3 in RAM, 4 deleted,
    5 never stored."""
    ns, keys = _ns("walk"), _keys(tokens=SESSION_TOKENS)
    with d.client() as c:
        c.register_namespace(ns, tokens_per_block=TPB)
        assert c.put_many(ns, keys[:4], [BLOCK] * 4).stored == 4          # RAM full: k0 k1 k2 k3
        c.hint(ns, [keys[0]], "demote")                                   # k0 to disk, its RAM freed
        wait_until(lambda: c.explain(ns, [keys[0]])[0].tier == Tier.DISK, what="block 0 demoted to disk")
        c.put(ns, keys[4], BLOCK)                                         # the freed slot
        c.register_namespace(ns + "-filler")
        c.put_many(ns + "-filler", [b"x1", b"x2"], [BLOCK] * 2)           # evicts k1, k2 (least recently used)
        assert c.delete(ns, [keys[4]]) == 1
        assert c.note_session(ns, "walk", keys) is True
    return ns, keys


def test_session_walks_ram_disk_and_evicted_blocks_with_exact_causes(tiered: DaemonProcess, capsys) -> None:
    ns, keys = _session_walk(tiered)
    doc = _json(tiered, capsys, "explain", "--session", "walk")
    assert doc["session"] == "walk" and len(doc["entries"]) == 1
    [e] = doc["entries"]
    assert (e["namespace"], e["ended"], e["tokens_per_block"]) == (ns, False, TPB)
    blocks = e["blocks"]
    assert [b["key"] for b in blocks] == [k.hex() for k in keys]
    assert [b["tokens"] for b in blocks] == [[0, 4], [4, 8], [8, 12], [12, 16], [16, 20], [20, 24]]
    assert [(b["tier"], b["cause"], b["policy"]) for b in blocks] == [
        ("disk", None, None), ("none", "evicted", "lru"), ("none", "evicted", "lru"), ("ram", None, None),
        ("none", "deleted", None), ("none", "never_stored", None)]
    assert [b["age_s"] is None for b in blocks] == [True, False, False, True, False, True]
    assert e["summary"] == {"blocks": 6, "by_tier": {"ram": 1, "disk": 1, "none": 4},
                            "misses_by_cause": _no_misses(evicted=2, deleted=1, never_stored=1), "prefix_blocks": 1,
                            "prefix_tokens": 4, "first_miss": {"index": 1, "cause": "evicted"}, "tail_tokens": 0}
    # the table: the namespace given picks the entry (it must match); the summary line is exact
    rc, out, err = _cli(tiered, capsys, "explain", ns, "--session", "walk")
    assert (rc, err) == (0, "")
    assert f"{ns}: session walk (live, noted " in out
    assert out.rstrip().splitlines()[-1] == (
        "6 block(s): ram 1, disk 1, missing 4; misses by cause: never_stored 1, evicted 2, deleted 1; a prefix "
        "Lookup hits the first 1 of 6 (4 tokens); first miss: block 1, evicted")
    assert "evicted (lru)" in out and "never_stored" in out
    # the session ends: still explained, marked ended; `kvstore sessions` lists it
    with tiered.client() as c:
        assert c.note_session(ns, "walk", [], ended=True) is True
    assert _json(tiered, capsys, "explain", "--session", "walk")["entries"][0]["ended"] is True
    listed = [s for s in _json(tiered, capsys, "sessions", "--limit", "0")["sessions"] if s["session"] == "walk"]
    assert [(s["namespace"], s["blocks"], s["ended"]) for s in listed] == [(ns, 6, True)]


@pytest.mark.parametrize("args, message", [
    (["explain", "--session", "nobody"], "no session 'nobody' in the daemon's session book: a session is noted"),
    (["explain", "{other}", "--session", "known"], "no session 'known' in namespace '{other}'"),
    (["explain", "explain-nobody", "--session", "known"], "unknown namespace 'explain-nobody': register it first"),
    (["explain", "{ns}", "0102", "--session", "known"], "--session names the blocks itself: drop KEY_HEX"),
    (["explain", "--session", "known", "--tokens-file", "t.txt"], "drop --tokens-file"),
    (["explain", "--session", ""], "--session needs a session id"),
    (["explain"], "give NAMESPACE (e.g. llama-3-8b@3f2a9c/default), or --session S"),
    (["sessions", "--limit", "-1"], None),
])
def test_bad_session_input_is_a_clear_error_and_exit_code_2(daemon: DaemonProcess, capsys, args: list[str],
                                                            message: str | None) -> None:
    ns, other = _ns("sess"), _ns("other")
    with daemon.client() as c:
        c.register_namespace(ns)
        c.register_namespace(other)
        c.note_session(ns, "known", [b"\x01\x02"])
    argv = [a.format(ns=ns, other=other) for a in args]
    if message is None:  # an argparse usage error
        with pytest.raises(SystemExit) as exc:
            main(["--address", daemon.address, *argv])
        assert exc.value.code == 2 and "use a whole number >= 0" in capsys.readouterr().err
        return
    rc, out, err = _cli(daemon, capsys, *argv)
    assert (rc, out) == (2, "") and err.startswith("kvstore: error: ") and message.format(other=other) in err, err
