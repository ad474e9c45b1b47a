"""`kvstore inspect`: where keys live (tier, size, pins, leases, age, node), and how much of a chain is stored.

Only the Describe RPC is used, never Lookup, on purpose: a Lookup (even `prefix=True, lease=False`) counts
as traffic in the hit-rate counters, touches the eviction policy (an inspected block would look recently
used) and starts promoting disk-only blocks into RAM, evicting others. Inspecting must not change what it
inspects, so the chain's longest present prefix is computed here from the Describe answer: the leading keys
present in any tier. That is the prefix a `lookup_prefix` would serve as long as promotions succeed.

Disk-only blocks carry no age (the disk index does not record one): it is shown as "-" / null. `node` is this
daemon's node id for every present key; when a peer tier exists it will name the node that holds the block.
Exit code 0 whenever the daemon answered: a missing key is part of the report, not a failure.
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
from kvstore.client import Client, KeyInfo

__all__ = ["Placement", "ChainSummary", "TIERS", "read_chain", "place", "summarize", "run"]

TIERS = ("ram", "ram+disk", "disk", "missing")


@dataclass(frozen=True)
class Placement:
    """Where one key lives; tier is one of TIERS."""

    key: bytes
    tier: str
    size: int
    pins: int
    leases: int
    age_s: float | None
    node: str | None
    tokens: int = 0       # tokens in the block (its namespace's tokens_per_block; 0 unknown or missing)

    def doc(self) -> dict[str, Any]:
        """JSON: a missing key has null size/pins/leases (unknown, not zero)."""
        known = self.tier != "missing"
        return {**render.key_doc(self.key), "tier": self.tier, "size": self.size if known else None,
                "pins": self.pins if known else None, "leases": self.leases if known else None,
                "age_s": None if self.age_s is None else round(self.age_s, 3), "node": self.node}


@dataclass(frozen=True)
class ChainSummary:
    length: int
    prefix: int           # leading keys present in some tier
    prefix_bytes: int
    counts: dict[str, int]         # per tier, over the whole chain
    prefix_counts: dict[str, int]  # per tier, over the present prefix
    prefix_tokens: int | None = None  # tokens in the present prefix; None when the namespace's are unknown


def read_chain(path: str, parse_key: Callable[[str], bytes]) -> list[bytes]:
    """One key per line in the CLI's key syntax (`parse_key`, main's); empty lines are skipped."""
    try:
        if path == "-":
            text = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as fh:
                text = fh.read()
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc.strerror or exc}") from exc
    keys = []
    for number, raw in enumerate(text.split(b"\n"), start=1):
        line = raw.removesuffix(b"\r").decode("utf-8", "surrogateescape")
        if not line:
            continue
        try:
            keys.append(parse_key(line))
        except argparse.ArgumentTypeError as exc:
            raise CommandError(f"{path}:{number}: {exc}") from None
    if not keys:
        raise CommandError(f"{path} holds no keys: give one key per line (text, or hex:<digits>)")
    return keys


def place(key: bytes, info: KeyInfo | None, node: str) -> Placement:
    if info is None:
        return Placement(key, "missing", 0, 0, 0, None, None)
    age = None if info.tier == "disk" else info.age_s
    return Placement(key, info.tier, info.size, info.pins, info.leases, age, node, info.tokens)


def summarize(rows: list[Placement]) -> ChainSummary:
    prefix = next((i for i, r in enumerate(rows) if r.tier == "missing"), len(rows))
    zero = dict.fromkeys(TIERS, 0)
    known = all(r.tokens for r in rows[:prefix]) and prefix > 0
    return ChainSummary(len(rows), prefix, sum(r.size for r in rows[:prefix]),
                        {**zero, **Counter(r.tier for r in rows)},
                        {**zero, **Counter(r.tier for r in rows[:prefix])},
                        sum(r.tokens for r in rows[:prefix]) if known else None)


def run(client: Client, args: argparse.Namespace, parse_key: Callable[[str], bytes]) -> int:
    """`parse_key` is passed in by main (which imports this module) so that chain files and argv agree."""
    if args.chain is not None and args.keys:
        raise CommandError("give KEYs or --chain FILE, not both")
    if args.chain is None and not args.keys:
        raise CommandError("give at least one KEY, or --chain FILE with one key per line")
    keys: list[bytes] = read_chain(args.chain, parse_key) if args.chain is not None else list(args.keys)
    infos = client.describe(args.namespace, keys)
    node = client.health().node_id
    rows = [place(k, info, node) for k, info in zip(keys, infos)]
    chain = summarize(rows) if args.chain is not None else None
    if args.json:
        doc: dict[str, Any] = {"namespace": args.namespace, "node": node, "keys": [r.doc() for r in rows]}
        if chain is not None:
            doc["chain"] = {"length": chain.length, "prefix": chain.prefix, "prefix_bytes": chain.prefix_bytes,
                            "prefix_tokens": chain.prefix_tokens, "counts": chain.counts,
                            "prefix_counts": chain.prefix_counts}
        render.emit_json(doc)
    else:
        _print(args.namespace, node, rows, chain)
    return 0


def _print(namespace: str, node: str, rows: list[Placement], chain: ChainSummary | None) -> None:
    c = Console(file=sys.stdout, highlight=False)
    t = Table(title=Text(f"{namespace} on node {node}: {len(rows)} key(s)"), title_justify="left")
    t.add_column("#", justify="right")
    t.add_column("key", overflow="fold")
    for name in ("tier", "size", "pins", "leases", "age", "node"):
        t.add_column(name, justify="left" if name in ("tier", "node") else "right", no_wrap=True)
    for i, r in enumerate(rows):
        missing = r.tier == "missing"
        t.add_row(str(i), Text(render.key_label(r.key)), Text(r.tier, style="red" if missing else ""),
                  "-" if missing else render.human_bytes(r.size), "-" if missing else str(r.pins),
                  "-" if missing else str(r.leases), "-" if r.age_s is None else render.human_age(r.age_s),
                  Text(r.node or "-"), end_section=chain is not None and i + 1 == chain.prefix < len(rows))
    c.print(t)
    if chain is not None:
        def counts(d: dict[str, int]) -> str:
            return ", ".join(f"{tier} {d[tier]}" for tier in TIERS)

        tokens = f", {chain.prefix_tokens} tokens" if chain.prefix_tokens is not None else ""
        c.print(Text(f"present prefix: {chain.prefix} of {chain.length} keys "
                     f"({render.human_bytes(chain.prefix_bytes)}{tokens}): {counts(chain.prefix_counts)}"))
        c.print(Text(f"whole chain: {counts(chain.counts)}"))
