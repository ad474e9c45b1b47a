"""`kvstore events`: tail the daemon's KV events (what a KV-aware router consumes), one line or JSON object each.

Lines go out as events arrive (flushed), so `kvstore events | grep moved` works live. A `gap` line means this
tail fell behind and the daemon dropped that many events for it rather than slow the store down.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvstore.cli.render import key_doc
from kvstore.client import Client, KVEvent

__all__ = ["run", "event_line", "event_doc"]


def event_doc(ev: KVEvent) -> dict[str, object]:
    doc: dict[str, object] = {"seq": ev.seq, "time": round(ev.time, 6), "node": ev.node_id, "kind": ev.kind}
    if ev.kind == "gap":
        doc["dropped"] = ev.dropped
        return doc
    doc.update(namespace=ev.namespace, tier=ev.tier, keys=[key_doc(k) for k in ev.keys])
    if ev.kind == "moved":
        doc["to_tier"] = ev.to_tier
    if ev.whole_namespace:
        doc["whole_namespace"] = True
    return doc


def event_line(ev: KVEvent) -> str:
    if ev.kind == "gap":
        return f"{ev.seq:>8} gap      {ev.dropped} events dropped (this tail fell behind)"
    where = f"{ev.tier}->{ev.to_tier}" if ev.kind == "moved" else ev.tier
    what = "whole namespace" if ev.whole_namespace else f"{len(ev.keys)} key(s)"
    first = ev.keys[0].hex() if ev.keys else ""
    more = f" {first}" + (" ..." if len(ev.keys) > 1 else "") if first else ""
    return f"{ev.seq:>8} {ev.kind:<8} {where:<9} {ev.namespace} {what}{more}"


def run(client: Client, args: argparse.Namespace) -> int:
    seen = 0
    with client.subscribe(args.namespace or (), buffer=args.buffer) as stream:
        for ev in stream:
            sys.stdout.write((json.dumps(event_doc(ev)) if args.json else event_line(ev)) + "\n")
            sys.stdout.flush()
            seen += 1
            if args.count is not None and seen >= args.count:
                break
    return 0
