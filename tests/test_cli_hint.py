"""`kvstore hint` against real daemons: every action with its outcomes from --tokens-file (keyed like the vLLM
connector, computed here independently with kvstore_connector.keys), --keys-file and hex arguments, exact rows, summary
line, --json and kvstore_hints_total; --help explains every action and outcome; every bad input answered with a
message and exit code 2 while the daemon keeps serving; another tenant's namespace is unknown.

Runs call `main([...])` in-process (output via capsys).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from kvstore_connector.keys import KeyChain, chain_root
from kvstore.cli.main import main
from kvstore.hint_vocab import HintAction, HintOutcome
from kvstore.testing import DaemonProcess
from tests.tenant_helpers import A_NS
from tests.test_hint_rpc import nonzero, scrape_hints, tenant_files

pytestmark = pytest.mark.timeout(90)
TOKENS = list(range(2000, 2022))  # 22 tokens: 5 full blocks of 4, 2 left over
TPB = 4
MiB = 1 << 20


def _ns(tag: str) -> str:
    return f"hint-{tag}-{uuid.uuid4().hex[:8]}"


def _cli(d: DaemonProcess, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """main's exit code, argparse's SystemExit included, and what it printed."""
    capsys.readouterr()
    try:
        rc = main(["--address", d.address, *args])
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def _json(d: DaemonProcess, capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    rc, out, err = _cli(d, capsys, "--json", *args)
    assert rc == 0, err
    return json.loads(out)


def _keys(seed: int = 0) -> list[bytes]:
    """The connector's keys, built here the way kvstore_connector/scheduler.py builds them."""
    return list(KeyChain(TPB, seed, chain_root(seed)).extend(TOKENS))


def _by(**counts: int) -> dict[str, int]:
    return {o.value: counts.get(o.value, 0) for o in HintOutcome}


@pytest.fixture()
def small(make_daemon) -> DaemonProcess:
    """No disk tier, a 4 MiB arena (the pin budget: 2 MiB), retain/pin ttls cut at 30 s."""
    return make_daemon(arena_bytes="4MiB", max_block_bytes="1MiB", high_watermark=1.0, low_watermark=1.0,
                       disk_bytes=0, hint_max_ttl_s=30)


def test_every_action_on_a_prompts_blocks_as_json(small: DaemonProcess, capsys, tmp_path: Path) -> None:
    ns, keys = _ns("tok"), _keys()
    with small.client() as c:
        c.register_namespace(ns, tokens_per_block=TPB)
        assert c.put_many(ns, [keys[i] for i in (0, 1, 4)], [b"kv%d" % i for i in (0, 1, 4)]).stored == 3
    f = tmp_path / "prompt.json"
    f.write_text(json.dumps(TOKENS))
    doc = _json(small, capsys, "hint", ns, "retain", "--tokens-file", str(f), "--ttl", "5")
    assert (doc["namespace"], doc["action"], doc["ttl_s"], doc["tokens_per_block"], doc["key_seed"]) == (
        ns, "retain", 5.0, 4, 0)
    assert [b["key"] for b in doc["blocks"]] == [k.hex() for k in keys]
    assert [b["tokens"] for b in doc["blocks"]] == [[0, 4], [4, 8], [8, 12], [12, 16], [16, 20]]
    assert [b["outcome"] for b in doc["blocks"]] == ["accepted", "accepted", "missing", "missing", "accepted"]
    assert doc["summary"] == {"blocks": 5, "by_outcome": _by(accepted=3, missing=2), "tail_tokens": 2}
    want = [("RETAIN", "100", _by(clipped=3, missing=2)),  # 100 s > hint_max_ttl_s
            ("release", "0", _by(accepted=3, missing=2)), ("demote", "0", _by(rejected=3, missing=2)),  # no disk
            ("Prefetch", "0", _by(accepted=3, missing=2)), ("pin", "5", _by(accepted=3, missing=2))]
    for action, ttl, by in want:
        doc = _json(small, capsys, "hint", ns, action, "--tokens-file", str(f), "--ttl", ttl)
        assert doc["action"] == action.lower() and doc["summary"]["by_outcome"] == by, action
    assert nonzero(scrape_hints(small)) == {
        "retain_accepted": 3, "retain_clipped": 3, "retain_missing": 4, "release_accepted": 3, "release_missing": 2,
        "demote_rejected": 3, "demote_missing": 2, "prefetch_accepted": 3, "prefetch_missing": 2,
        "pin_accepted": 3, "pin_missing": 2}


def test_pin_over_the_budget_is_rejected_table_and_summary(small: DaemonProcess, capsys, tmp_path: Path) -> None:
    ns = _ns("pin")
    names = [b"\x01\x01", b"\x02\x02", b"\x03\x03"]
    with small.client() as c:
        c.register_namespace(ns)
        c.put_many(ns, names, [b"p" * MiB] * 3)
    f = tmp_path / "keys.txt"
    f.write_text("0101\n\nhex:0202\r\n0303\n")
    rc, out, err = _cli(small, capsys, "hint", ns, "pin", "--keys-file", str(f), "--ttl", "10")
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[-1] == "pin (ttl 10s) on 3 block(s): accepted 2, clipped 0, deferred 0, rejected 1, missing 0"
    cells = [line.replace("┃", "│").split("│") for line in lines if line.startswith(("│", "┃"))]  # header ┃, rows │
    rows = {c[1].strip(): [cell.strip() for cell in c[2:-1]] for c in cells}
    assert rows == {"#": ["key", "outcome"], "0": ["0101", "accepted"], "1": ["0202", "accepted"],
                    "2": ["0303", "rejected"]}
    with small.client() as c:
        assert [i.pins for i in c.describe(ns, names) if i is not None] == [1, 1, 0]
    rc, out, _ = _cli(small, capsys, "hint", ns, "release", "0303", "0404")
    assert rc == 0 and out.splitlines()[-1] == ("release on 2 block(s): accepted 1, clipped 0, deferred 0, "
                                                "rejected 0, missing 1")
    assert nonzero(scrape_hints(small)) == {"pin_accepted": 2, "pin_rejected": 1, "release_accepted": 1,
                                            "release_missing": 1}


def test_help_explains_every_action_and_outcome(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["hint", "--help"])
    assert exc.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    for word in [*HintAction, *HintOutcome]:
        described = [ln for ln in lines if ln.startswith(f"  {word.value} ")]
        assert len(described) == 1 and len(described[0].split()) > 3, word  # a line of its own that says what


@pytest.fixture(scope="module")
def daemon():
    with DaemonProcess(arena_bytes="16MiB", max_block_bytes="1MiB") as d:
        yield d


ACTIONS = "use one of retain, release, demote, prefetch, pin"


@pytest.mark.parametrize("setup, args, message", [
    ("plain", ["hint", "{ns}", "bogus", "0102"], f"unknown hint action 'bogus': {ACTIONS}"),
    ("plain", ["hint", "{ns}", "retain", "0102", "--ttl", "abc"], "--ttl 'abc': give a number of seconds >= 0"),
    ("plain", ["hint", "{ns}", "retain", "0102", "--ttl", "-1"], "--ttl '-1': give a number of seconds >= 0"),
    ("plain", ["hint", "{ns}", "pin", "0102", "--ttl", "nan"], "--ttl 'nan': give a number of seconds >= 0"),
    ("plain", ["hint", "{ns}", "retain", "0102"], "hint retain needs ttl_s > 0 (how long to keep the blocks)"),
    ("plain", ["hint", "{ns}", "pin", "0102", "--ttl", "0"], "hint pin needs ttl_s > 0"),
    ("plain", ["hint", "{ns}", "release", "0g"], "'0g' is not a hex key: give an even number of hex digits"),
    ("", ["hint", "hint-nobody", "release", "0102"], "unknown namespace 'hint-nobody': register it first"),
    ("plain", ["hint", "{ns}", "release"], "give exactly one of KEY_HEX..., --keys-file F or --tokens-file F"),
    ("plain", ["hint", "{ns}", "release", "0102", "--keys-file", "{keys}"], "(got KEY_HEX and --keys-file)"),
    ("plain", ["hint", "{ns}", "release", "--tokens-file", "{tokens}"], "was registered without tokens_per_block"),
    ("plain", ["hint", "{ns}", "release", "--keys-file", "{badhex}"], "badhex.txt:2: 'xyz' is not a hex key"),
    ("tpb", ["hint", "{ns}", "release", "--tokens-file", "{short}"], "3 token(s) make no full block of 4 tokens"),
])
def test_bad_input_is_a_clear_error_and_exit_code_2(daemon: DaemonProcess, capsys, tmp_path: Path, setup: str,
                                                     args: list[str], message: str) -> None:
    ns = _ns("bad")
    with daemon.client() as c:
        if setup:
            c.register_namespace(ns, tokens_per_block=TPB if setup == "tpb" else None)
    files = {"tokens": "1 2 3 4 5", "keys": "0102\n", "badhex": "0102\nxyz\n", "short": "[1, 2, 3]"}
    fmt = {"ns": ns}
    for name, text in files.items():
        (tmp_path / f"{name}.txt").write_text(text)
        fmt[name] = str(tmp_path / f"{name}.txt")
    rc, out, err = _cli(daemon, capsys, *[a.format(**fmt) for a in args])
    assert (rc, out) == (2, "") and message in err, err
    if setup:  # and the daemon keeps serving
        doc = _json(daemon, capsys, "hint", ns, "release", "0102")
        assert doc["summary"]["by_outcome"] == _by(missing=1)


def test_another_tenants_namespace_is_unknown_to_the_cli(tmp_path: Path, capsys) -> None:
    tokens, alice, bob = tenant_files(tmp_path)
    with DaemonProcess(tokens_file=tokens) as d:
        with d.client(token_file=alice) as c:
            c.register_namespace(A_NS)
            c.put(A_NS, b"\x01\x02", b"kv")
        capsys.readouterr()
        assert main(["--address", d.address, "--token-file", bob, "hint", A_NS, "pin", "0102", "--ttl", "9"]) == 2
        assert f"unknown namespace {A_NS!r}: register it first" in capsys.readouterr().err
        with d.client(token_file=alice) as c:
            assert [i.pins for i in c.describe(A_NS, [b"\x01\x02"]) if i is not None] == [0]
        assert main(["--address", d.address, "--token-file", alice, "--json", "hint", A_NS, "pin", "0102",
                     "--ttl", "9"]) == 0
        assert json.loads(capsys.readouterr().out)["summary"]["by_outcome"] == _by(accepted=1)
