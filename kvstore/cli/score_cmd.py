"""`kvstore score`: how much of a prompt each live node of the cluster would serve, and from where: what a router
that does not read KV events asks before it picks a node (Client.prefix_score, the PrefixScore RPC).

The blocks are named as for `kvstore explain` (keys_input.py: KEY_HEX..., --keys-file, or a prompt's token ids
keyed like the vLLM connector). One call to the daemon, which asks every other member once; metadata only.
Exit code 0 whenever the daemon answered, 2 for bad input.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvstore.cli import render
from kvstore.cli.keys_input import add_key_arguments, resolve_keys
from kvstore.client import Client, NodeScore

__all__ = ["DESCRIPTION", "add_parser", "run", "best"]

DESCRIPTION = """\
For every live node of the cluster (this node alone without a peer tier): how many leading tokens of a prompt it
holds in RAM, on its disk, and how many more its own lookup would fetch from peers, i.e. the prefix its vLLM
would load instead of computing. The prefix of a node ends at the first block that neither it nor a peer it
would ask holds. One call, metadata only: no lease, no lookup counted, no block promoted or fetched.

With --tokens-file the keys are the vLLM connector's: full blocks of the namespace's registered tokens_per_block,
chained from --key-seed (the connector's key_seed, default 0) and --lora-name (the request's LoRA, if any). The
best node (most tokens in its own RAM and disk, then in all) is marked: where a router would send the prompt."""

EPILOG = """\
examples:
  kvstore score llama-3-8b@3f2a9c/default --tokens-file prompt.json
  kvstore score myns --keys-file chain.txt --json"""


def best(scores: list[NodeScore]) -> NodeScore | None:
    """The node a router would pick: the most blocks it holds itself (RAM, then disk), then the most in all."""
    return max(scores, key=lambda s: (s.ram_blocks + s.disk_blocks, s.blocks, s.ram_blocks, s.is_self),
               default=None)


def run(client: Client, args: argparse.Namespace) -> int:
    given = resolve_keys(client, args)
    scores = client.prefix_score(args.namespace, given.keys)
    top = best(scores)
    if args.json:
        render.emit_json({"namespace": args.namespace, "blocks": len(given.keys),
                          "tokens_per_block": given.tokens_per_block, "best": top.node_id if top else None,
                          "nodes": [{"node_id": s.node_id, "control_address": s.control_address, "self": s.is_self,
                                     "answered": s.answered, "ram_blocks": s.ram_blocks, "disk_blocks": s.disk_blocks,
                                     "peer_blocks": s.peer_blocks, "ram_tokens": s.ram_tokens,
                                     "disk_tokens": s.disk_tokens, "peer_tokens": s.peer_tokens} for s in scores]})
        return 0
    unit = "tokens" if given.tokens_per_block else "blocks"
    c = Console(file=sys.stdout, highlight=False)
    t = Table(title=Text(f"{args.namespace}: a chain of {len(given.keys)} block(s), per node ({unit})"),
              title_justify="left")
    for col in ("node", "ram", "disk", "peer", "total", ""):
        t.add_column(col, justify="left" if col in ("node", "") else "right", no_wrap=True)
    for s in scores:
        n = (s.ram_tokens, s.disk_tokens, s.peer_tokens) if given.tokens_per_block else (
            s.ram_blocks, s.disk_blocks, s.peer_blocks)
        note = ("best " if s is top else "") + ("(this node)" if s.is_self else "") + (
            "" if s.answered else " did not answer")
        t.add_row(s.node_id, *(str(x) for x in n), str(sum(n)), note.strip())
    c.print(t)
    if top is not None:  # one plain line, never wrapped: scripts grep it
        render.say(f"best: {top.node_id} ({top.ram_blocks} ram + {top.disk_blocks} disk + {top.peer_blocks} peer "
                   f"of {len(given.keys)} blocks)")
    return 0


def add_parser(sub: Any, add_globals: Callable[[argparse.ArgumentParser, bool], None]) -> argparse.ArgumentParser:
    """The `score` subparser (main.py's build_parser calls this; `add_globals` is its global options)."""
    sp: argparse.ArgumentParser = sub.add_parser(
        "score", help="per live node: a prompt's leading tokens in its RAM, on its disk, and from peers",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("namespace", metavar="NAMESPACE", help="namespace name, e.g. llama-3-8b@3f2a9c/default")
    add_key_arguments(sp)
    add_globals(sp, False)
    return sp
