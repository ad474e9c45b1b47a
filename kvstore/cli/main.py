"""`kvstore`: inspect and edit a running kvstore-server from the shell.

This module is only the argparse wiring and the one place where errors become exit codes; each subcommand
lives in `commands.py` (the live `top` view in `top.py`, `inspect` in `inspect_cmd.py`, `events` in
`events_cmd.py`, `explain` in `explain_cmd.py`, `hint` in `hint_cmd.py`, `sessions` in `sessions_cmd.py` and `score` in `score_cmd.py`, which also build their own parsers) and shared output
formats in `render.py`. Global options are accepted before or after the
subcommand (`kvstore --json stats` and `kvstore stats --json`), because people type both.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Callable, Sequence

from kvstore.cli import events_cmd, explain_cmd, hint_cmd, inspect_cmd, score_cmd, sessions_cmd, top
from kvstore.cli.commands import COMMANDS, CommandError
from kvstore.client import Client
from kvstore.client.rpc import tls_from_env
from kvstore.security.tls import TlsFiles
from kvstore.errors import KVStoreError

__all__ = ["main", "build_parser", "parse_key"]

_KEY_HELP = "a key: UTF-8 text, or hex:<digits> for raw bytes (e.g. hex:00ff1a)"

# name -> (help line, description, example lines)
_SPECS: dict[str, tuple[str, str, str]] = {
    "stats": ("show daemon statistics",
              "Arena usage (capacity, allocated, stored, reserved, leased, pinned, fragmentation, mlock), block and "
              "lease counts, counters, per-namespace usage and allocator size classes.",
              "kvstore stats\n  kvstore stats --json | jq .namespaces"),
    "health": ("check that the daemon answers",
               "Identity, version, arena and limits of the daemon. Exits 0 when it is SERVING, 1 otherwise.",
               "kvstore health\n  kvstore --address 127.0.0.1:7070 health"),
    "ls": ("list the keys of a namespace",
           "Keys in byte order with tier, size, age, pins and leases. Keys are shown as hex, plus their text when "
           "they are printable UTF-8.",
           "kvstore ls llama-3-8b@3f2a9c/default --limit 20"),
    "show": ("show one key's record",
             "Size, tier, age, pins, leases and checksum of one block. Exits 1 when the key is absent.",
             "kvstore show myns prompt-0\n  kvstore show myns hex:9f86d081884c7d65"),
    "put": ("store a file's bytes as one block",
            "Reads FILE (or stdin for '-') and stores its bytes under KEY. Registers NAMESPACE first when the "
            "daemon does not know it (with an empty model/layout); --no-register fails instead. Blocks are "
            "immutable: an existing key is left as it is.",
            "kvstore put myns prompt-0 block.bin\n  head -c 4096 /dev/urandom | kvstore put myns hex:00ff -"),
    "get": ("fetch one block's bytes",
            "Writes the block's bytes to stdout (binary-safe; --json does not wrap them) or to -o FILE (then a "
            "summary is printed, as JSON with --json). Exits 1 with a message when the key is absent.",
            "kvstore get myns prompt-0 > block.bin\n  kvstore get myns hex:00ff -o block.bin"),
    "delete": ("delete keys", "Deletes the given keys and reports how many were present.",
               "kvstore delete myns prompt-0 prompt-1"),
    "pin": ("pin keys so eviction skips them", "Pins the given keys (pins nest: unpin as often as you pinned) "
            "and reports how many changed.", "kvstore pin myns system-prompt"),
    "unpin": ("unpin keys", "Removes one pin from each given key and reports how many changed.",
              "kvstore unpin myns system-prompt"),
    "clear": ("delete every block of a namespace",
              "Deletes all blocks of NAMESPACE (the namespace stays registered). Refuses unless --yes is given.",
              "kvstore clear myns --yes"),
    "top": ("live view of hit rates, throughput and occupancy",
            "Refreshes every --interval seconds from two successive stats snapshots: hit rate per tier (total "
            "and over the last interval), committed/read/disk bytes per second, RAM and disk occupancy, leases, "
            "evictions and promotions per second, disk state and the 10 busiest namespaces. The first frame "
            "comes after one interval. q or Ctrl-C quits; --iterations N stops after N frames (for scripts; "
            "output that is not a terminal gets only the last frame). --json prints the last frame as JSON.",
            "kvstore top\n  kvstore top --interval 5 --iterations 12 > top.txt"),
    "events": ("tail the daemon's KV events (stored / removed / moved, by tier)",
               "One line per event as it happens: blocks stored in a tier, removed from it, or moved between RAM and "
               "disk, with the namespace and keys; what a KV-aware router indexes. A 'gap' line counts events the "
               "daemon dropped because this tail read too slowly. --json prints one JSON object per line.",
               "kvstore events\n  kvstore events --namespace llama-3-8b@3f2a9c/default --json --count 100"),
    "inspect": ("where keys live: tier, size, pins, leases, age, node",
                "For each KEY (or each line of --chain FILE, one key per line in the same syntax, - for stdin) "
                "shows its tier (ram, disk, ram+disk or missing), size, pins, leases, age (none for disk-only "
                "blocks) and node. With --chain it also reports the longest present prefix and per-tier counts. "
                "Read-only: it uses Describe, not Lookup, so it counts no lookups, refreshes no block in the "
                "eviction order and does not promote disk-only blocks into RAM. Exits 0 when the daemon answered, "
                "missing keys included.",
                "kvstore inspect myns prompt-0 hex:9f86d0\n  kvstore inspect myns --chain chain.txt --json"),
}


def parse_key(text: str) -> bytes:
    """The key syntax of every command; argv's undecodable bytes (surrogateescape) come back as themselves."""
    if text.startswith("hex:"):
        try:
            key = bytes.fromhex(text[4:])
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: after 'hex:' give an even number of hex digits") from None
    else:
        key = text.encode("utf-8", "surrogateescape")
    if not key:
        raise argparse.ArgumentTypeError("empty key: keys are 1..64 bytes")
    return key


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of seconds > 0")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number >= 1")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number >= 0")
    return value


def _add_globals(p: argparse.ArgumentParser, defaults: bool) -> None:
    """On the top parser with real defaults; on subparsers with SUPPRESS so they never overwrite those."""
    d = (lambda v: v) if defaults else (lambda v: argparse.SUPPRESS)
    g = p.add_argument_group("global options")
    g.add_argument("--address", default=d(None), metavar="ADDR",
                   help="daemon address: unix:/path, /path or host:port "
                        "[default: $KVSTORE_ADDRESS, else the per-user unix socket]")
    g.add_argument("--json", action="store_true", default=d(False),
                   help="print exactly one JSON document (keys as hex, plus key_text when printable)")
    g.add_argument("--timeout", type=_positive_float, default=d(10.0), metavar="SECONDS",
                   help="deadline of each call to the daemon [default: 10]")
    g.add_argument("--token-file", default=d(None), metavar="FILE",
                   help="owner-only file holding this tenant's bearer token (never the token itself) "
                        "[default: $KVSTORE_TOKEN_FILE]")
    g.add_argument("--tls-ca", default=d(None), metavar="FILE",
                   help="PEM CA to verify a TCP daemon's certificate (TLS) [default: $KVSTORE_TLS_CA]")
    g.add_argument("--tls-cert", default=d(None), metavar="FILE",
                   help="PEM client certificate for mutual TLS [default: $KVSTORE_TLS_CERT]")
    g.add_argument("--tls-key", default=d(None), metavar="FILE",
                   help="PEM private key of --tls-cert [default: $KVSTORE_TLS_KEY]")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstore", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Inspect and edit a running kvstore-server (the KV-cache offload daemon).",
        epilog="exit codes: 0 ok, 1 key not found / daemon not serving, 2 error\n"
               "examples:\n  kvstore stats\n  kvstore put myns k1 block.bin && kvstore get myns k1 > copy.bin",
    )
    _add_globals(p, defaults=True)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (summary, description, example) in _SPECS.items():
        sp = sub.add_parser(name, help=summary, description=textwrap.fill(description, 90),
                            epilog=f"example:\n  {example}", formatter_class=argparse.RawDescriptionHelpFormatter)
        if name not in ("stats", "health", "top", "events"):
            sp.add_argument("namespace", metavar="NAMESPACE",
                            help="namespace name, e.g. llama-3-8b@3f2a9c/default")
        if name in ("show", "put", "get"):
            sp.add_argument("key", metavar="KEY", type=parse_key, help=_KEY_HELP)
        if name in ("delete", "pin", "unpin"):
            sp.add_argument("keys", metavar="KEY", nargs="+", type=parse_key, help=_KEY_HELP)
        if name == "put":
            sp.add_argument("file", metavar="FILE", help="file to store, or - for stdin")
            sp.add_argument("--no-register", dest="register", action="store_false",
                            help="fail on an unknown namespace instead of registering it")
        if name == "get":
            sp.add_argument("-o", "--output", metavar="FILE", help="write the bytes here instead of stdout")
        if name == "ls":
            sp.add_argument("--limit", type=_non_negative_int, default=1000, metavar="N",
                            help="list at most N keys; 0 for all [default: 1000]")
        if name == "clear":
            sp.add_argument("--yes", action="store_true", help="confirm deleting every block")
        if name == "top":
            sp.add_argument("--interval", type=_positive_float, default=2.0, metavar="SECONDS",
                            help="seconds between refreshes [default: 2]")
            sp.add_argument("--iterations", type=_positive_int, default=None, metavar="N",
                            help="stop after N refreshes [default: until q or Ctrl-C]")
        if name == "events":
            sp.add_argument("--namespace", action="append", metavar="NS",
                            help="only this namespace (repeatable) [default: all]")
            sp.add_argument("--count", type=_positive_int, default=None, metavar="N",
                            help="exit after N events [default: until Ctrl-C]")
            sp.add_argument("--buffer", type=_positive_int, default=4096, metavar="N",
                            help="events the daemon buffers for this tail before dropping [default: 4096]")
        if name == "inspect":
            sp.add_argument("keys", metavar="KEY", nargs="*", type=parse_key, help=_KEY_HELP)
            sp.add_argument("--chain", metavar="FILE",
                            help="a chain of keys, one per line (text or hex:...), - for stdin; "
                                 "reports its longest present prefix")
        _add_globals(sp, defaults=False)
    explain_cmd.add_parser(sub, _add_globals)  # its help lists the miss causes: a parser of its own
    hint_cmd.add_parser(sub, _add_globals)  # its help lists the actions and outcomes: a parser of its own
    sessions_cmd.add_parser(sub, _add_globals)
    score_cmd.add_parser(sub, _add_globals)
    return p


def _handler(name: str) -> Callable[[Client, argparse.Namespace], int]:
    """commands.COMMANDS is looked up at call time (tests patch it); top and inspect live in their own modules."""
    extra: dict[str, Callable[[Client, argparse.Namespace], int]] = {
        "top": top.run, "events": events_cmd.run, "inspect": _inspect, "explain": explain_cmd.run,
        "hint": hint_cmd.run, "sessions": sessions_cmd.run, "score": score_cmd.run}
    return COMMANDS.get(name) or extra[name]


def _inspect(client: Client, args: argparse.Namespace) -> int:
    """inspect asks the other cluster members too, with this invocation's credentials."""
    def connect(address: str) -> Client:
        return Client(address, timeout_s=args.timeout, token_file=args.token_file, tls=_tls(args))
    return inspect_cmd.run(client, args, parse_key=parse_key, connect=connect)


def _tls(args: argparse.Namespace) -> TlsFiles | None:
    """Flags override the KVSTORE_TLS_* environment one by one; None when neither gives anything."""
    env = tls_from_env()
    tls = TlsFiles(args.tls_cert or env.cert, args.tls_key or env.key, args.tls_ca or env.ca)
    return tls if tls.enabled else None


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code (argparse errors exit 2 by raising SystemExit)."""
    args = build_parser().parse_args(argv)
    try:
        with Client(args.address, timeout_s=args.timeout, token_file=args.token_file, tls=_tls(args)) as client:
            return _handler(args.command)(client, args)
    except (KVStoreError, CommandError) as exc:
        print(f"kvstore: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `kvstore get ... | head`: the reader left; point stdout at /dev/null so the exit flush stays quiet.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is not a real file (e.g. captured by a test)
            pass
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
