"""`kvstore inspect`: where keys live (tier, size, pins, leases, age, node), and how much of a chain is stored.

Only the Describe RPC is used, never Lookup, on purpose: a Lookup (even `prefix=True, lease=False`) counts
as traffic in the hit-rate counters, touches the eviction policy (an inspected block would look recently
used) and starts promoting disk-only blocks into RAM, evicting others. Inspecting must not change what it
inspects, so the chain's longest present prefix is computed here from the Describe answer: the leading keys
present in any tier. That is the prefix a `lookup_prefix` would serve as long as promotions succeed.

Disk-only blocks carry no age (the disk index does not record one): it is shown as "-" / null.
Across nodes: when the daemon belongs to a cluster (peer tier), the same Describe goes to every other live
member (one call per node, its control address from the member set, the same credentials). A key held only
elsewhere has tier "peer" and `node` names the first node that holds it; `nodes` lists every holder with its
tier. A member that does not answer is reported on stderr and skipped. The present prefix counts keys held on
any node: a Lookup on this node would fetch those from their owners.
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
from kvstore.errors import KVStoreError

__all__ = ["Placement", "ChainSummary", "TIERS", "read_chain", "place", "describe_peers", "summarize", "run"]

TIERS = ("ram", "ram+disk", "disk", "peer", "missing")


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
    nodes: tuple[tuple[str, str], ...] = ()  # every (node, tier) holding it, this node first

    def doc(self) -> dict[str, Any]:
        """JSON: a missing key has null size/pins/leases (unknown, not zero)."""
        known = self.tier != "missing"
        return {**render.key_doc(self.key), "tier": self.tier, "size": self.size if known else None,
                "pins": self.pins if known else None, "leases": self.leases if known else None,
                "age_s": None if self.age_s is None else round(self.age_s, 3), "node": self.node,
                "nodes": [{"node": n, "tier": t} for n, t in self.nodes]}


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


def place(key: bytes, info: KeyInfo | None, node: str,
          remote: list[tuple[str, KeyInfo]] | None = None) -> Placement:
    """This node's answer for `key`, plus the (node, info) of other members that hold it."""
    remote = remote or []
    holders: tuple[tuple[str, str], ...] = ((node, info.tier),) if info is not None else ()
    holders += tuple((n, i.tier) for n, i in remote)
    if info is None:
        if not remote:
            return Placement(key, "missing", 0, 0, 0, None, None)
        n, first = remote[0]
        return Placement(key, "peer", first.size, first.pins, first.leases, None, n, first.tokens, holders)
    age = None if info.tier == "disk" else info.age_s
    return Placement(key, info.tier, info.size, info.pins, info.leases, age, node, info.tokens, holders)


def describe_peers(client: Client, namespace: str, keys: list[bytes],
                   connect: Callable[[str], Client] | None) -> list[list[tuple[str, KeyInfo]]]:
    """Per key, the (node, info) of every other live cluster member that holds it (none when alone)."""
    out: list[list[tuple[str, KeyInfo]]] = [[] for _ in keys]
    peers = client.health().peers
    if peers is None or connect is None:
        return out
    for m in peers.members:
        if m.is_self:
            continue
        if not m.control_address:  # its listen is '' (a socket-only node): nothing to ask from here
            print(f"kvstore: warning: node {m.node_id} serves no TCP gRPC (its listen is empty): run "
                  "`kvstore inspect` on that node for its copies", file=sys.stderr)
            continue
        try:
            with connect(m.control_address) as other:
                infos = other.describe(namespace, keys)
        except KVStoreError as exc:
            print(f"kvstore: warning: node {m.node_id} ({m.control_address}) did not answer: {exc}", file=sys.stderr)
            continue
        for i, info in enumerate(infos):
            if info is not None:
                out[i].append((m.node_id, info))
    return out


def summarize(rows: list[Placement]) -> ChainSummary:
    prefix = next((i for i, r in enumerate(rows) if r.tier == "missing"), len(rows))
    zero = dict.fromkeys(TIERS, 0)
    known = all(r.tokens for r in rows[:prefix]) and prefix > 0
    return ChainSummary(len(rows), prefix, sum(r.size for r in rows[:prefix]),
                        {**zero, **Counter(r.tier for r in rows)},
                        {**zero, **Counter(r.tier for r in rows[:prefix])},
                        sum(r.tokens for r in rows[:prefix]) if known else None)


def run(client: Client, args: argparse.Namespace, parse_key: Callable[[str], bytes],
        connect: Callable[[str], Client] | None = None) -> int:
    """`parse_key` is passed in by main (which imports this module) so that chain files and argv agree;
    `connect(address)` opens a client to another cluster member with the same credentials."""
    if args.chain is not None and args.keys:
        raise CommandError("give KEYs or --chain FILE, not both")
    if args.chain is None and not args.keys:
        raise CommandError("give at least one KEY, or --chain FILE with one key per line")
    keys: list[bytes] = read_chain(args.chain, parse_key) if args.chain is not None else list(args.keys)
    infos = client.describe(args.namespace, keys)
    node = client.health().node_id
    remote = describe_peers(client, args.namespace, keys, connect)
    rows = [place(k, info, node, r) for k, info, r in zip(keys, infos, remote)]
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
                  Text(", ".join(f"{n} ({t})" for n, t in r.nodes) or "-"), end_section=chain is not None and i + 1 == chain.prefix < len(rows))
    c.print(t)
    if chain is not None:
        def counts(d: dict[str, int]) -> str:
            return ", ".join(f"{tier} {d[tier]}" for tier in TIERS)

        tokens = f", {chain.prefix_tokens} tokens" if chain.prefix_tokens is not None else ""
        c.print(Text(f"present prefix: {chain.prefix} of {chain.length} keys "
                     f"({render.human_bytes(chain.prefix_bytes)}{tokens}): {counts(chain.prefix_counts)}"))
        c.print(Text(f"whole chain: {counts(chain.counts)}"))
