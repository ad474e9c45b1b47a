"""Which blocks a command is about: KEY_HEX... arguments, --keys-file, or a prompt's token ids (--tokens-file).

Shared by `kvstore explain` and `kvstore hint`, so both read keys and tokens alike and the same bad input gets
the same message. Token ids become the keys the vLLM connector computes for them (kvstore_connector/keys.py: a chain
over the full blocks of the namespace's registered tokens_per_block, rooted at chain_root(--key-seed,
--lora-name)); a trailing part block has no key (the connector stores full blocks only) and is left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from kvstore_connector.keys import KeyChain, chain_root
from kvstore.cli.commands import CommandError
from kvstore.client import Client
from kvstore.validation import MAX_KEY_BYTES

__all__ = ["KeyInput", "add_key_arguments", "resolve_keys", "parse_hex_key", "read_keys_file", "read_tokens_file",
           "chain_keys", "namespace_tokens_per_block"]

_MAX_SEED = (1 << 64) - 1
_MAX_TOKEN = (1 << 63) - 1  # the connector hashes token ids as int64


@dataclass(frozen=True)
class KeyInput:
    """The keys asked about and, with token ids, the tokens each covers."""

    keys: list[bytes]
    spans: list[tuple[int, int] | None]  # [start, end) token positions per key; None without tokens
    tokens_per_block: int | None = None  # the namespace's, with --tokens-file
    tail_tokens: int = 0                 # tokens past the last full block (no key)


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
    """The connector's keys of the full blocks of `tokens` (kvstore_connector/keys.py)."""
    return list(KeyChain(tokens_per_block, seed, chain_root(seed, lora_name=lora_name)).extend(tokens))


def namespace_tokens_per_block(client: Client, namespace: str) -> int:
    """The namespace's registered tokens_per_block (Stats lists the namespaces this caller may see)."""
    found = next((n for n in client.stats().namespaces if n.name == namespace), None)
    if found is None:
        raise CommandError(f"unknown namespace {namespace!r}: register it first (RegisterNamespace)")
    if not found.tokens_per_block:
        raise CommandError(f"namespace {namespace!r} was registered without tokens_per_block, so token ids cannot "
                           "be cut into its blocks: give the keys instead (--keys-file or KEY_HEX...)")
    return found.tokens_per_block


def resolve_keys(client: Client, args: argparse.Namespace) -> KeyInput:
    """The keys that add_key_arguments' options name (exactly one source); CommandError for bad input."""
    given = [name for name, v in (("KEY_HEX", args.keys), ("--keys-file", args.keys_file),
                                  ("--tokens-file", args.tokens_file)) if v]
    if len(given) != 1:
        raise CommandError(f"give exactly one of KEY_HEX..., --keys-file F or --tokens-file F (got "
                           f"{' and '.join(given) or 'none'})")
    if not args.tokens_file:
        keys = read_keys_file(args.keys_file) if args.keys_file else list(args.keys)
        return KeyInput(keys, [None] * len(keys))
    tokens = read_tokens_file(args.tokens_file)
    tpb = namespace_tokens_per_block(client, args.namespace)
    keys = chain_keys(tokens, tpb, args.key_seed, args.lora_name)
    if not keys:
        raise CommandError(f"{args.tokens_file}: {len(tokens)} token(s) make no full block of {tpb} tokens "
                           f"(namespace {args.namespace!r}): nothing is stored for them")
    spans: list[tuple[int, int] | None] = [(i * tpb, (i + 1) * tpb) for i in range(len(keys))]
    return KeyInput(keys, spans, tpb, len(tokens) - len(keys) * tpb)


def add_key_arguments(sp: argparse.ArgumentParser) -> None:
    """KEY_HEX..., --keys-file, --tokens-file, --key-seed, --lora-name (after the NAMESPACE positional)."""
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


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= _MAX_SEED:
        raise argparse.ArgumentTypeError(f"{text!r}: a key seed is a whole number 0..{_MAX_SEED}")
    return value
