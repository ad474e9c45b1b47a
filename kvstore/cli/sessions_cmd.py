"""`kvstore sessions`: the daemon's session book (kvstore/engine/sessions.py), most recently noted first.

One row per entry: a session in one namespace (each shard namespace of a tensor-parallel model has its own),
its chain's length in blocks, how long ago it was noted and whether it ended (released). What `kvstore explain
--session S` explains. Read-only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from kvstore.cli import render
from kvstore.client import Client

__all__ = ["add_parser", "run"]


def run(client: Client, args: argparse.Namespace) -> int:
    shown, total = client.sessions(args.limit)
    if args.json:
        render.emit_json({"total": total, "sessions": [
            {"session": s.session, "namespace": s.namespace, "blocks": s.blocks, "age_s": round(s.age_s, 3),
             "ended": s.ended} for s in shown]})
        return 0
    t = Table(title=f"session book: {total} entr{'y' if total == 1 else 'ies'}", title_justify="left")
    for name, justify in (("session", "left"), ("namespace", "left"), ("blocks", "right"), ("noted", "right"),
                          ("state", "left")):
        t.add_column(name, justify=justify, no_wrap=name != "session")  # type: ignore[arg-type]
    for s in shown:
        t.add_row(s.session, s.namespace, str(s.blocks), render.human_age(s.age_s) + " ago",
                  "ended" if s.ended else "live")
    Console(file=sys.stdout, highlight=False).print(t)
    if len(shown) < total:
        render.say(f"{total - len(shown)} more: raise --limit (0 for all)")
    return 0


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 1 << 32:
        raise argparse.ArgumentTypeError(f"{text!r}: use a whole number >= 0 (0 lists every entry)")
    return value


def add_parser(sub: Any, add_globals: Callable[[argparse.ArgumentParser, bool], None]) -> argparse.ArgumentParser:
    """The `sessions` subparser (main.py's build_parser calls this; `add_globals` is its global options)."""
    sp: argparse.ArgumentParser = sub.add_parser(
        "sessions", help="the daemon's session book: sessions `kvstore explain --session` can explain",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        epilog="examples:\n  kvstore sessions\n  kvstore sessions --limit 0 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("--limit", type=_limit, default=100, metavar="N",
                    help="list at most N entries, most recently noted first; 0 for all [default: 100]")
    add_globals(sp, False)
    return sp
