"""`kvstore explain`: block by block, where each key of a request lives now, or why it is not there.

The keys come from argv or --keys-file (hex, one per line), or from a prompt's token ids (--tokens-file), turned
(keys_input.py, shared with `kvstore hint`) into the keys the vLLM connector computes for them (kvstore_connector/keys.py: a chain over the full blocks of the
namespace's registered tokens_per_block, rooted at chain_root(--key-seed, --lora-name)). A trailing part block
has no key (the connector stores full blocks only) and is left out.

With --session S the keys are the chain the daemon's session book holds for S (kvstore/engine/sessions.py: the
vLLM connector notes each session's latest finished request, one entry per shard namespace; the ExplainSession
RPC explains each), one table and summary per entry; NAMESPACE, when given, picks that entry.

Only the Explain RPC is used (ExplainSession with --session): like `inspect`, explaining must not change what it explains, so nothing is counted
as a lookup, no block is refreshed in the eviction order and no disk block is promoted. The "leading hits" of the
summary are the blocks a prefix Lookup would find now (RAM or disk): the part of the prompt the store would
serve. Exit code 0 whenever the daemon answered: misses are part of the report, not a failure.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvstore.cli import render
from kvstore.cli.commands import CommandError
from kvstore.cli.keys_input import (add_key_arguments, chain_keys, parse_hex_key, read_keys_file, read_tokens_file,
                                    resolve_keys)
from kvstore.client import Client, KeyExplanation
from kvstore.engine.misses import CAUSES, CLEARED, DELETED, DISK_RECLAIMED, EVICTED
from kvstore.vocab import TIER_NAMES

# parse_hex_key, read_keys_file, read_tokens_file and chain_keys live in keys_input.py (shared with `hint`)
__all__ = ["DESCRIPTION", "EPILOG", "Row", "Summary", "add_parser", "parse_hex_key", "read_keys_file",
           "read_tokens_file", "chain_keys", "summarize", "run"]

_AGED = (EVICTED, DISK_RECLAIMED, DELETED, CLEARED)  # causes with a time: the age column shows how long ago

DESCRIPTION = """\
For each block of a request (KEY_HEX..., --keys-file, or the token ids of a prompt with --tokens-file) shows
where its key lives now in NAMESPACE (ram or disk) or, when it is absent, why: one cause per missing block.
Then a summary: blocks by tier, misses by cause, and where the leading run of hits ends (what a prefix Lookup
would serve now; the first miss there is the one that cost the request its cache). Read-only: it counts no
lookup, refreshes no block in the eviction order and promotes nothing.

With --session S the blocks are those of session S's latest finished request, as the vLLM connector noted
them in the daemon's session book (a request names its session with kv_transfer_params {"kvstore_session": S}):
one table per namespace holding the session (each shard of a tensor-parallel model has its own), or only
NAMESPACE's when given. `kvstore sessions` lists the sessions the book holds.

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
  kvstore explain myns 9f86d081884c7d659a2feaa0c55ad015
  kvstore explain --session agent-42
  kvstore explain llama-3-8b@3f2a9c/default --session agent-42 --json"""


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


def summarize(rows: list[Row], tokens_per_block: int | None, tail_tokens: int = 0) -> Summary:
    prefix = next((r.index for r in rows if not r.explanation.present), len(rows))
    tiers = Counter(TIER_NAMES[r.explanation.tier] for r in rows)
    causes = Counter(r.explanation.cause for r in rows if not r.explanation.present)
    return Summary(len(rows), {t: tiers[t] for t in ("ram", "disk", "none")}, {c: causes[c] for c in CAUSES},
                   prefix, prefix * tokens_per_block if tokens_per_block else None,
                   rows[prefix].where if prefix < len(rows) else "", tail_tokens)


def run(client: Client, args: argparse.Namespace) -> int:
    if args.session is not None:
        return _run_session(client, args)
    if not args.namespace:
        raise CommandError("give NAMESPACE (e.g. llama-3-8b@3f2a9c/default), or --session S to explain a session")
    given = resolve_keys(client, args)
    keys, spans, tpb, tail = given.keys, given.spans, given.tokens_per_block, given.tail_tokens
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


def _run_session(client: Client, args: argparse.Namespace) -> int:
    """--session: each entry of the session (one per shard namespace) as its own table and summary."""
    other = [n for n, v in (("KEY_HEX", args.keys), ("--keys-file", args.keys_file),
                            ("--tokens-file", args.tokens_file)) if v]
    if other:
        raise CommandError(f"--session names the blocks itself: drop {' and '.join(other)}")
    if not args.session:
        raise CommandError("--session needs a session id (the request's kv_transfer_params 'kvstore_session')")
    entries = client.explain_session(args.session, args.namespace or "")
    tpb = {n.name: n.tokens_per_block or None for n in client.stats().namespaces}
    docs: list[dict[str, Any]] = []
    for e in entries:
        per = tpb.get(e.namespace)  # a session chain starts at token 0: block i covers [i*tpb, (i+1)*tpb)
        rows = [Row(i, k, x, (i * per, (i + 1) * per) if per else None)
                for i, (k, x) in enumerate(zip(e.keys, e.explanations))]
        summary = summarize(rows, per)
        state = "ended" if e.ended else "live"
        if args.json:
            docs.append({"namespace": e.namespace, "ended": e.ended, "age_s": round(e.age_s, 3),
                         "tokens_per_block": per, "blocks": [r.doc() for r in rows], "summary": summary.doc()})
        else:
            _print(e.namespace, rows, summary,
                   f"{e.namespace}: session {e.session} ({state}, noted {render.human_age(e.age_s)} ago)")
    if args.json:
        render.emit_json({"session": args.session, "entries": docs})
    return 0


def _print(namespace: str, rows: list[Row], summary: Summary, title: str = "") -> None:
    c = Console(file=sys.stdout, highlight=False)
    t = Table(title=Text(f"{title or namespace}: {len(rows)} block(s)"), title_justify="left")
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
    sp.add_argument("namespace", metavar="NAMESPACE", nargs="?", default=None,
                    help="namespace name, e.g. llama-3-8b@3f2a9c/default (optional with --session)")
    add_key_arguments(sp)
    sp.add_argument("--session", metavar="S", default=None,
                    help="explain session S's latest finished request (the daemon's session book; see above)")
    add_globals(sp, False)
    return sp

