"""`kvstore hint`: send an agent's hint (retain, release, demote, prefetch, pin) on a request's blocks, from a
shell or an orchestrator, while no generation runs (a session waiting on a tool, a finished branch).

The blocks are named as for `kvstore explain` (keys_input.py: KEY_HEX..., --keys-file, or a prompt's token ids
keyed like the vLLM connector). The daemon answers one outcome per block (kvstore/hint_vocab.py); they are
printed with a summary by outcome. Exit code 0 whenever the daemon answered, whatever the outcomes (a rejected
or missing block is part of the report); 2 for bad input, including an action or ttl the daemon refuses.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvstore.cli import render
from kvstore.cli.keys_input import add_key_arguments, resolve_keys
from kvstore.client import Client
from kvstore.hint_vocab import HintAction, HintOutcome

__all__ = ["DESCRIPTION", "EPILOG", "add_parser", "parse_action", "parse_ttl", "summary_line", "run"]

_ACTIONS = ", ".join(a.value for a in HintAction)

DESCRIPTION = """\
Sends a hint about blocks of NAMESPACE (KEY_HEX..., --keys-file, or the token ids of a prompt with --tokens-file)
to the daemon: what an agent runtime knows that the cache cannot (a session resumes after a tool call, a branch
is done). Prints each block's outcome, then the blocks by outcome. Hints steer eviction and the tiers; they
never change what a lookup returns.

With --tokens-file the keys are the vLLM connector's: full blocks of the namespace's registered tokens_per_block,
chained from --key-seed (the connector's key_seed, default 0) and --lora-name (the request's LoRA, if any)."""

EPILOG = """\
actions (ACTION, case-insensitive):
  retain    keep the blocks in RAM for --ttl seconds while anything else can go: still evictable under
            pressure, not a pin (needs --ttl > 0; longer than the daemon's hint_max_ttl_s is cut to it)
  release   the session or branch is done: its blocks are the first to go from RAM
  demote    move the blocks to the disk tier now and free their RAM (needs a disk tier)
  prefetch  bring the blocks from disk or a peer into RAM before the next turn reads them
  pin       never evict the blocks for --ttl seconds (needs --ttl > 0, cut to hint_max_ttl_s), counted against
            the tenant's pinned budget (its RAM quota, or half the arena without quotas); refused beyond it
outcomes (one per block):
  accepted  done (or already so)
  clipped   done, with the ttl cut to the daemon's hint_max_ttl_s
  deferred  under way: completes when a pending disk write or promotion lands (demote), or when a block
            still being written commits (retain, release, demote, pin)
  rejected  refused: no disk tier (demote), the pin budget is spent (pin), pinned (demote), not in RAM (retain,
            pin: prefetch it first), or the disk write queue is full
  missing   the block is stored in no tier
examples:
  kvstore hint llama-3-8b@3f2a9c/default retain --tokens-file prompt.json --ttl 30
  kvstore hint myns prefetch --keys-file keys.txt --json
  kvstore hint myns release 9f86d081884c7d659a2feaa0c55ad015"""


def parse_action(text: str) -> HintAction:
    try:
        return HintAction(text.strip().lower())
    except ValueError:
        raise argparse.ArgumentTypeError(f"unknown hint action {text!r}: use one of {_ACTIONS}") from None


def parse_ttl(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"--ttl {text!r}: give a number of seconds >= 0 (e.g. 30 or 2.5)")
    return value


def summary_line(outcomes: list[HintOutcome], action: HintAction, ttl_s: float) -> str:
    counts = Counter(outcomes)
    by = ", ".join(f"{o.value} {counts[o]}" for o in HintOutcome)
    ttl = f" (ttl {ttl_s:g}s)" if action in (HintAction.RETAIN, HintAction.PIN) else ""
    return f"{action.value}{ttl} on {len(outcomes)} block(s): {by}"


def run(client: Client, args: argparse.Namespace) -> int:
    given = resolve_keys(client, args)
    outcomes = client.hint(args.namespace, given.keys, args.action, args.ttl)
    counts = Counter(outcomes)
    if args.json:
        blocks: list[dict[str, Any]] = []
        for i, (key, outcome, span) in enumerate(zip(given.keys, outcomes, given.spans)):
            doc: dict[str, Any] = {"index": i, **render.key_doc(key), "outcome": outcome.value}
            if span is not None:
                doc["tokens"] = list(span)
            blocks.append(doc)
        render.emit_json({"namespace": args.namespace, "action": args.action.value, "ttl_s": args.ttl,
                          "tokens_per_block": given.tokens_per_block,
                          "key_seed": args.key_seed if given.tokens_per_block else None, "blocks": blocks,
                          "summary": {"blocks": len(outcomes), "by_outcome": {o.value: counts[o] for o in HintOutcome},
                                      "tail_tokens": given.tail_tokens}})
        return 0
    c = Console(file=sys.stdout, highlight=False)
    t = Table(title=Text(f"{args.namespace}: {args.action.value} on {len(outcomes)} block(s)"), title_justify="left")
    t.add_column("#", justify="right")
    if given.tokens_per_block:
        t.add_column("tokens", justify="right", no_wrap=True)
    t.add_column("key", no_wrap=True)
    t.add_column("outcome", no_wrap=True)
    for i, (key, outcome, span) in enumerate(zip(given.keys, outcomes, given.spans)):
        cells: list[str | Text] = [str(i)]
        if span is not None:
            cells.append(f"{span[0]}-{span[1] - 1}")
        style = "red" if outcome in (HintOutcome.REJECTED, HintOutcome.MISSING) else ""
        cells += [key.hex()[:16] + ("…" if len(key) > 8 else ""), Text(outcome.value, style=style)]
        t.add_row(*cells)
    c.print(t)
    render.say(summary_line(outcomes, args.action, args.ttl))  # one plain line, never wrapped: scripts grep it
    return 0


def add_parser(sub: Any, add_globals: Callable[[argparse.ArgumentParser, bool], None]) -> argparse.ArgumentParser:
    """The `hint` subparser (main.py's build_parser calls this; `add_globals` is its global options)."""
    sp: argparse.ArgumentParser = sub.add_parser(
        "hint", help="an agent's hint on blocks: retain, release, demote, prefetch or pin; one outcome each",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("namespace", metavar="NAMESPACE", help="namespace name, e.g. llama-3-8b@3f2a9c/default")
    sp.add_argument("action", metavar="ACTION", type=parse_action, help=f"one of {_ACTIONS} (see below)")
    add_key_arguments(sp)
    sp.add_argument("--ttl", type=parse_ttl, default=0.0, metavar="SECONDS",
                    help="how long retain or pin lasts (required > 0 for them; ignored by the others)")
    add_globals(sp, False)
    return sp
