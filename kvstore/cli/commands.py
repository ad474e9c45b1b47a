"""One function per `kvstore` subcommand: `(client, args) -> exit code`.

Exit codes: 0 done; 1 an expected miss (`get`/`show` of an absent key, `health` of a daemon that is not
serving), so scripts can branch on it; 2 the request could not be served (raised as `KVStoreError` or
`CommandError` and printed once by `main`). Deleting or pinning absent keys is not an error: the counts say
what changed, as the Client API does.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable

from kvstore.cli import render
from kvstore.client import Client, KeyInfo
from kvstore.errors import UnknownNamespaceError

__all__ = ["CommandError", "COMMANDS", "find_key"]



class CommandError(Exception):
    """A request the CLI itself refuses (unreadable file, missing --yes): printed like a KVStoreError."""


def _label(key: bytes) -> str:
    return render.key_label(key)


def stats(client: Client, args: argparse.Namespace) -> int:
    s = client.stats()
    if args.json:
        render.emit_json(render.stats_doc(s))
    else:
        render.print_stats(s)
    return 0


def health(client: Client, args: argparse.Namespace) -> int:
    h = client.health()
    if args.json:
        render.emit_json(dataclasses.asdict(h))
    else:
        render.print_health(h)
    return 0 if h.status == "SERVING" else 1


def ls(client: Client, args: argparse.Namespace) -> int:
    limit = args.limit or None
    infos = list(client.keys(args.namespace, limit=None if limit is None else limit + 1))
    truncated = limit is not None and len(infos) > limit
    infos = infos[:limit]
    if args.json:
        render.emit_json({"namespace": args.namespace, "count": len(infos), "truncated": truncated,
                          "keys": [render.key_info_doc(k) for k in infos]})
    else:
        render.print_keys(args.namespace, infos, truncated)
    return 0


def find_key(client: Client, namespace: str, key: bytes) -> KeyInfo | None:
    """One key's record (Describe RPC: O(1) in the daemon, unlike scanning a listing)."""
    return client.describe(namespace, [key])[0]


def _miss(args: argparse.Namespace, key: bytes) -> int:
    """A miss is an answer, not a failure: exit 1, a message on stderr, and a document for --json."""
    render.warn(f"key {_label(key)!r} not found in namespace {args.namespace!r}")
    if args.json:
        render.emit_json({"namespace": args.namespace, **render.key_doc(key), "found": False})
    return 1


def show(client: Client, args: argparse.Namespace) -> int:
    info = find_key(client, args.namespace, args.key)
    if info is None:
        return _miss(args, args.key)
    if args.json:
        render.emit_json({"namespace": args.namespace, "found": True, **render.key_info_doc(info)})
    else:
        render.print_key(args.namespace, info)
    return 0


def _read_input(path: str) -> bytes:
    if path == "-":
        return sys.stdin.buffer.read()
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc.strerror or exc}") from exc


def put(client: Client, args: argparse.Namespace) -> int:
    data = _read_input(args.file)
    if not data:
        raise CommandError(f"{args.file} is empty: a block needs at least 1 byte")
    if client.max_block_bytes and len(data) > client.max_block_bytes:
        raise CommandError(f"{args.file} has {len(data)} bytes; this daemon stores blocks of at most "
                           f"{client.max_block_bytes} bytes (max_block_bytes)")
    registered = False
    try:
        res = client.put_many(args.namespace, [args.key], [data])
    except UnknownNamespaceError:
        if not args.register:
            raise
        # Register only on a miss: re-registering a namespace that has a model/layout would be a conflict.
        registered = client.register_namespace(args.namespace)
        res = client.put_many(args.namespace, [args.key], [data])
    if args.json:
        render.emit_json({"namespace": args.namespace, **render.key_doc(args.key), "size": len(data),
                          "stored": res.stored == 1, "already_present": res.already_present == 1,
                          "in_flight": res.in_flight == 1, "registered_namespace": registered})
        return 0
    if registered:
        render.say(f"registered namespace {args.namespace}")
    if res.stored:
        render.say(f"stored {_label(args.key)} ({len(data)} bytes) in {args.namespace}")
    elif res.in_flight:
        render.say(f"{_label(args.key)} is being written by another client; not stored")
    else:
        render.say(f"{_label(args.key)} already present in {args.namespace}; not replaced "
                   "(blocks are immutable: delete it first to store new bytes)")
    return 0


def get(client: Client, args: argparse.Namespace) -> int:
    data = client.get(args.namespace, args.key)
    if data is None:
        return _miss(args, args.key)
    if args.output in (None, "-"):
        sys.stdout.buffer.write(data)  # raw bytes: no summary, so `kvstore get ... > f` is exact
        sys.stdout.buffer.flush()
        return 0
    try:
        with open(args.output, "wb") as fh:
            fh.write(data)
    except OSError as exc:
        raise CommandError(f"cannot write {args.output}: {exc.strerror or exc}") from exc
    if args.json:
        render.emit_json({"namespace": args.namespace, **render.key_doc(args.key), "found": True,
                          "size": len(data), "output": args.output})
    else:
        render.say(f"wrote {len(data)} bytes to {args.output}")
    return 0


def _counted(verb: str, fn: Callable[[Client, str, list[bytes]], int]) -> Callable[[Client, argparse.Namespace], int]:
    """delete/pin/unpin share one shape: N keys in, how many changed out."""

    def run(client: Client, args: argparse.Namespace) -> int:
        keys: list[bytes] = list(dict.fromkeys(args.keys))  # a key named twice counts once
        n = fn(client, args.namespace, keys)
        if args.json:
            render.emit_json({"namespace": args.namespace, verb: n, "requested": len(keys)})
        else:
            render.say(f"{verb} {n} of {len(keys)} key(s) in {args.namespace}")
        return 0

    run.__name__ = verb
    return run


def clear(client: Client, args: argparse.Namespace) -> int:
    if not args.yes:
        raise CommandError(f"clear deletes every block of namespace {args.namespace!r}; "
                           "pass --yes to confirm")
    n = client.clear(args.namespace)
    if args.json:
        render.emit_json({"namespace": args.namespace, "deleted": n})
    else:
        render.say(f"deleted {n} block(s) from {args.namespace}")
    return 0


COMMANDS: dict[str, Callable[[Client, argparse.Namespace], int]] = {
    "stats": stats,
    "health": health,
    "ls": ls,
    "show": show,
    "put": put,
    "get": get,
    "delete": _counted("deleted", Client.delete),
    "pin": _counted("pinned", Client.pin),
    "unpin": _counted("unpinned", Client.unpin),
    "clear": clear,
}
