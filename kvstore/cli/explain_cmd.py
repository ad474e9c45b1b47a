"""`kvstore explain`: block by block, where each key of a request lives now, or why it is not there.

The keys come from argv or --keys-file (hex, one per line), or from a prompt's token ids (--tokens-file), turned
into the keys the vLLM connector computes for them (connector/keys.py: a chain over the full blocks of the
namespace's registered tokens_per_block, rooted at chain_root(--key-seed, --lora-name)). A trailing part block
has no key (the connector stores full blocks only) and is left out.

Only the Explain RPC is used: like `inspect`, explaining must not change what it explains, so nothing is counted
as a lookup, no block is refreshed in the eviction order and no disk block is promoted. The "leading hits" of the
summary are the blocks a prefix Lookup would find now (RAM or disk): the part of the prompt the store would
serve. Exit code 0 whenever the daemon answered: misses are part of the report, not a failure.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from connector.keys import KeyChain, chain_root
from kvstore.cli import render
from kvstore.cli.commands import CommandError
from kvstore.client import Client, KeyExplanation
from kvstore.engine.misses import CAUSES, CLEARED, DELETED, DISK_RECLAIMED, EVICTED
from kvstore.validation import MAX_KEY_BYTES
from kvstore.vocab import TIER_NAMES

__all__ = ["DESCRIPTION", "EPILOG", "Row", "Summary", "add_parser", "parse_hex_key", "read_keys_file",
           "read_tokens_file", "chain_keys", "summarize", "run"]

_AGED = (EVICTED, DISK_RECLAIMED, DELETED, CLEARED)  # causes with a time: the age column shows how long ago
_MAX_SEED = (1 << 64) - 1
_MAX_TOKEN = (1 << 63) - 1  # the connector hashes token ids as int64

DESCRIPTION = """\
For each block of a request (KEY_HEX..., --keys-file, or the token ids of a prompt with --tokens-file) shows
where its key lives now in NAMESPACE (ram or disk) or, when it is absent, why: one cause per missing block.
Then a summary: blocks by tier, misses by cause, and where the leading run of hits ends (what a prefix Lookup
would serve now; the first miss there is the one that cost the request its cache). Read-only: it counts no
lookup, refreshes no block in the eviction order and promotes nothing.

With --tokens-file the keys are the vLLM connector's: full blocks of the namespace's registered tokens_per_block,
chained from --key-seed (the connector's key_seed, default 0) and --lora-name (the request's LoRA, if any)."""

EPILOG = """\
causes (the column 'where' of a missing block; age: how long ago it left):
  never_stored     nothing known: never stored under this namespace, or stored so long ago that the daemon's
                   bounded record of removals (miss_ledger_keys) forgot it
  evicted          evicted from RAM with no disk copy, by the eviction policy shown (e.g. 'evicted (lru)'):
                   RAM (and disk) too small for the working set; pins or a larger arena keep such blocks
  disk_reclaimed   its last copy was on disk and the disk tier reclaimed that segment to make room
  deleted          a Delete removed it (kvstore delete, Client.delete)
  cleared          its namespace was cleared after it was stored (kvstore clear): every key absent after a
                   Clear is reported so, even one the namespace never held
  other_namespace  absent here but held now (in RAM) by the namespaces listed: the keys match but the namespace
                   does not (another model, KV layout, cache_salt or connector key_seed); with tokens only
                   your own namespaces are listed
  load_failed (present in a tier, but its promotion from disk failed, timed out or found no room) is counted
  by Lookups only (kvstore_misses_total{cause}): a block present in a tier is shown by its tier here.
reading it:
  A request reuses its cached prefix only up to the first missing block, so the first miss's cause is the one
  to act on; later misses are usually the same story (an evicted head takes its tail with it).
examples:
  kvstore explain llama-3-8b@3f2a9c/default --tokens-file prompt.json
  kvstore explain myns --keys-file keys.txt --json
  kvstore explain myns 9f86d081884c7d659a2feaa0c55ad015"""


@dataclass(frozen=True)
class Row:
    """One block: its key, what the daemon said, and the token ids it covers (token input only)."""

    index: int
    key: bytes
    explanation: KeyExplanation
    tokens: tuple[int, int] | None = None  # [start, end) token positions

    @property
    def where(self) -> str:
        """The tier's name when present, else the cause."""
        e = self.explanation
        return TIER_NAMES[e.tier] if e.present else e.cause

    def doc(self) -> dict[str, Any]:
        e = self.explanation
        doc: dict[str, Any] = {"index": self.index, **render.key_doc(self.key), "tier": TIER_NAMES[e.tier],
                               "cause": e.cause or None, "age_s": round(e.age_s, 3) if e.cause in _AGED else None,
                               "policy": e.policy or None, "other_namespaces": list(e.other_namespaces)}
        if self.tokens is not None:
            doc["tokens"] = list(self.tokens)
        return doc


@dataclass(frozen=True)
class Summary:
    blocks: int
    by_tier: dict[str, int]      # ram, disk, none
    by_cause: dict[str, int]     # every cause, zero included
    prefix: int                  # leading blocks present (what a prefix Lookup would hit)
    prefix_tokens: int | None    # tokens in them; None when not from tokens
    first_miss: str = ""         # the cause of block `prefix` ("" when every block is present)
    tail_tokens: int = 0         # tokens past the last full block (no key)

    def doc(self) -> dict[str, Any]:
        return {"blocks": self.blocks, "by_tier": self.by_tier, "misses_by_cause": self.by_cause,
                "prefix_blocks": self.prefix, "prefix_tokens": self.prefix_tokens,
                "first_miss": {"index": self.prefix, "cause": self.first_miss} if self.first_miss else None,
                "tail_tokens": self.tail_tokens}

    def line(self) -> str:
        tiers = ", ".join(f"{'missing' if t == 'none' else t} {n}" for t, n in self.by_tier.items())
        causes = ", ".join(f"{c} {n}" for c, n in self.by_cause.items() if n) or "none"
        tokens = f" ({self.prefix_tokens} tokens)" if self.prefix_tokens is not None else ""
        end = f"; first miss: block {self.prefix}, {self.first_miss}" if self.first_miss else "; no miss"
        tail = f"; {self.tail_tokens} token(s) past the last full block have no key" if self.tail_tokens else ""
        return (f"{self.blocks} block(s): {tiers}; misses by cause: {causes}; a prefix Lookup hits the first "
                f"{self.prefix} of {self.blocks}{tokens}{end}{tail}")


def parse_hex_key(text: str) -> bytes:
    """A key as hex digits (an optional 'hex:' prefix, as other commands write it, is accepted)."""
    digits = text.strip().removeprefix("hex:")
    try:
        key = bytes.fromhex(digits)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a hex key: give an even number of hex digits "
                                         "(e.g. 9f86d081)") from None
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r}: a key is 1..{MAX_KEY_BYTES} bytes "
                                         f"(2..{2 * MAX_KEY_BYTES} hex digits)")
    return key


def _read_text(path: str) -> str:
    try:
        if path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise CommandError(f"cannot read {path}: {why}") from exc


def read_keys_file(path: str) -> list[bytes]:
    """One hex key per line; blank lines are skipped."""
    keys = []
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            keys.append(parse_hex_key(line))
        except argparse.ArgumentTypeError as exc:
            raise CommandError(f"{path}:{number}: {exc}") from None
    if not keys:
        raise CommandError(f"{path} holds no keys: give one hex key per line")
    return keys


def read_tokens_file(path: str) -> list[int]:
    """A JSON list of token ids, or token ids separated by whitespace."""
    text = _read_text(path).strip()
    if not text:
        raise CommandError(f"{path} holds no token ids: give a JSON list ([1, 2, 3]) or whitespace-separated ints")
    words: list[Any]
    if text.startswith("["):
        try:
            words = json.loads(text)
        except ValueError as exc:
            raise CommandError(f"{path}: not a JSON list of token ids ({exc})") from None
    else:
        words = text.split()
    tokens = []
    for i, w in enumerate(words):
        try:
            t = w if isinstance(w, int) and not isinstance(w, bool) else int(w) if isinstance(w, str) else None
        except ValueError:
            t = None
        if t is None or not 0 <= t <= _MAX_TOKEN:
            raise CommandError(f"{path}: token {i} is {w!r}: token ids are integers 0..{_MAX_TOKEN}")
        tokens.append(t)
    if not tokens:
        raise CommandError(f"{path} holds no token ids: give a JSON list ([1, 2, 3]) or whitespace-separated ints")
    return tokens


def chain_keys(tokens: list[int], tokens_per_block: int, seed: int, lora_name: str | None = None) -> list[bytes]:
    """The connector's keys of the full blocks of `tokens` (connector/keys.py)."""
    return list(KeyChain(tokens_per_block, seed, chain_root(seed, lora_name=lora_name)).extend(tokens))


def summarize(rows: list[Row], tokens_per_block: int | None, tail_tokens: int = 0) -> Summary:
    prefix = next((r.index for r in rows if not r.explanation.present), len(rows))
    tiers = Counter(TIER_NAMES[r.explanation.tier] for r in rows)
    causes = Counter(r.explanation.cause for r in rows if not r.explanation.present)
    return Summary(len(rows), {t: tiers[t] for t in ("ram", "disk", "none")}, {c: causes[c] for c in CAUSES},
                   prefix, prefix * tokens_per_block if tokens_per_block else None,
                   rows[prefix].where if prefix < len(rows) else "", tail_tokens)


def _tokens_per_block(client: Client, namespace: str) -> int:
    """The namespace's registered tokens_per_block (Stats lists the namespaces this caller may see)."""
    found = next((n for n in client.stats().namespaces if n.name == namespace), None)
    if found is None:
        raise CommandError(f"unknown namespace {namespace!r}: register it first (RegisterNamespace)")
    if not found.tokens_per_block:
        raise CommandError(f"namespace {namespace!r} was registered without tokens_per_block, so token ids cannot "
                           "be cut into its blocks: give the keys instead (--keys-file or KEY_HEX...)")
    return found.tokens_per_block


def run(client: Client, args: argparse.Namespace) -> int:
    given = [name for name, v in (("KEY_HEX", args.keys), ("--keys-file", args.keys_file),
                                  ("--tokens-file", args.tokens_file)) if v]
    if len(given) != 1:
        raise CommandError(f"give exactly one of KEY_HEX..., --keys-file F or --tokens-file F (got "
                           f"{' and '.join(given) or 'none'})")
    tpb: int | None = None
    spans: list[tuple[int, int] | None]
    tail = 0
    if args.tokens_file:
        tokens = read_tokens_file(args.tokens_file)
        tpb = _tokens_per_block(client, args.namespace)
        keys = chain_keys(tokens, tpb, args.key_seed, args.lora_name)
        tail = len(tokens) - len(keys) * tpb
        if not keys:
            raise CommandError(f"{args.tokens_file}: {len(tokens)} token(s) make no full block of {tpb} tokens "
                               f"(namespace {args.namespace!r}): nothing is stored for them")
        spans = [(i * tpb, (i + 1) * tpb) for i in range(len(keys))]
    else:
        keys = read_keys_file(args.keys_file) if args.keys_file else list(args.keys)
        spans = [None] * len(keys)
    explained = client.explain(args.namespace, keys)
    rows = [Row(i, k, e, s) for i, (k, e, s) in enumerate(zip(keys, explained, spans))]
    summary = summarize(rows, tpb, tail)
    if args.json:
        doc: dict[str, Any] = {"namespace": args.namespace, "tokens_per_block": tpb,
                               "key_seed": args.key_seed if tpb else None, "blocks": [r.doc() for r in rows],
                               "summary": summary.doc()}
        render.emit_json(doc)
    else:
        _print(args.namespace, rows, summary)
    return 0


def _print(namespace: str, rows: list[Row], summary: Summary) -> None:
    c = Console(file=sys.stdout, highlight=False)
    t = Table(title=Text(f"{namespace}: {len(rows)} block(s)"), title_justify="left")
    with_tokens = rows[0].tokens is not None
    t.add_column("#", justify="right")
    if with_tokens:
        t.add_column("tokens", justify="right", no_wrap=True)
    t.add_column("key", no_wrap=True)
    t.add_column("where", no_wrap=True)
    t.add_column("age", justify="right", no_wrap=True)
    t.add_column("other namespaces", overflow="fold")
    for r in rows:
        e = r.explanation
        where = f"{r.where} ({e.policy})" if e.policy else r.where
        cells: list[str | Text] = [str(r.index)]
        if r.tokens is not None:
            cells.append(f"{r.tokens[0]}-{r.tokens[1] - 1}")
        cells += [r.key.hex()[:16] + ("…" if len(r.key) > 8 else ""), Text(where, style="" if e.present else "red"),
                  render.human_age(e.age_s) if e.cause in _AGED else "-", Text(", ".join(e.other_namespaces) or "-")]
        t.add_row(*cells, end_section=r.index + 1 == summary.prefix < len(rows))
    c.print(t)
    render.say(summary.line())  # one plain line, never wrapped: scripts grep it


def add_parser(sub: Any, add_globals: Callable[[argparse.ArgumentParser, bool], None]) -> argparse.ArgumentParser:
    """The `explain` subparser (main.py's build_parser calls this; `add_globals` is its global options)."""
    sp: argparse.ArgumentParser = sub.add_parser(
        "explain", help="why a request's blocks missed: block by block, where each lives or why not",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("namespace", metavar="NAMESPACE", help="namespace name, e.g. llama-3-8b@3f2a9c/default")
    sp.add_argument("keys", metavar="KEY_HEX", nargs="*", type=parse_hex_key,
                    help="a block key as hex digits (as `kvstore ls` shows them)")
    sp.add_argument("--keys-file", metavar="F", help="one hex key per line, - for stdin")
    sp.add_argument("--tokens-file", metavar="F",
                    help="a prompt's token ids: a JSON list or whitespace-separated ints, - for stdin; cut into the "
                         "namespace's tokens_per_block and keyed like the vLLM connector")
    sp.add_argument("--key-seed", type=_seed, default=0, metavar="N",
                    help="the connector's key_seed, with --tokens-file [default: 0]")
    sp.add_argument("--lora-name", default=None, metavar="NAME",
                    help="the request's LoRA adapter name, with --tokens-file (part of the connector's keys)")
    add_globals(sp, False)
    return sp


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= _MAX_SEED:
        raise argparse.ArgumentTypeError(f"{text!r}: a key seed is a whole number 0..{_MAX_SEED}")
    return value
