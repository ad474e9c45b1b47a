"""Reading ServerConfig: embedded defaults < a TOML file < KVSTORE_* environment < command-line flags.

Each field of ServerConfig is at once a TOML key (`arena_bytes = "4GiB"`), an environment variable
(`KVSTORE_ARENA_BYTES=4GiB`) and a flag (`--arena-bytes 4GiB`), so the three can never drift apart. Values are
coerced to the field's type here (sizes take units) and the result is validated before anything is created.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import fields

from kvstore.errors import ConfigError
from kvstore.server.config.checks import validate
from kvstore.server.config.settings import ServerConfig
from kvstore.server.config.units import parse_size

__all__ = ["load_config", "build_arg_parser", "env_name", "flag_name"]


def env_name(name: str) -> str:
    return "KVSTORE_" + name.upper()


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


_KINDS = {"int": ("a whole number", "16"), "float": ("a number", "0.5"), "str": ("a string", '"text"'),
          "bool": ("true or false", "true")}


def _wrong(name: str, source: str, kind: str, raw: object) -> ConfigError:
    """One line: the setting, where it came from, what it got and how to write it instead."""
    what, example = _KINDS[kind]
    got = type(raw).__name__ if isinstance(raw, (list, dict)) else repr(raw)
    if source.startswith("KVSTORE_"):
        how = f"{source}={example.strip(chr(34))}"
    elif source.startswith("--"):
        how = f"{source} {example.strip(chr(34))}"
    else:
        how = f"{name} = {example}"
        if kind == "str" and isinstance(raw, list):
            how += " (several values: one comma-separated string)"
    return ConfigError(f"{name} (from {source}): expected {what}, got {got}; write e.g. {how}")


def _coerce(f: dataclasses.Field, raw: object, source: str) -> object:
    what = f"{f.name} (from {source})"
    if f.name.endswith("_bytes"):
        return parse_size(raw, what)  # type: ignore[arg-type]  # parse_size refuses what is not a str or int
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(raw, str) and raw.lower() in ("0", "false", "no", "off"):
            return False
        raise _wrong(f.name, source, kind, raw)
    try:
        if kind == "int":
            if isinstance(raw, (bool, float)):
                raise ValueError
            return int(raw)  # type: ignore[call-overload]  # TypeError from a TOML table is caught below
        if kind == "float":
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)  # type: ignore[arg-type]  # TypeError from a TOML table is caught below
    except (TypeError, ValueError):
        raise _wrong(f.name, source, kind, raw) from None
    if f.name.endswith("_budget") and isinstance(raw, int) and not isinstance(raw, bool):
        return str(raw)  # a rate written as a TOML integer (bytes per second)
    if not isinstance(raw, str):
        raise _wrong(f.name, source, "str", raw)
    return raw


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstore-server",
        description="kvstore daemon: a shared-memory RAM tier for KV-cache blocks with a gRPC control plane. "
        "Every option can also be set in the TOML file given by --config or as KVSTORE_<NAME> in the environment "
        "(precedence: flag > env > file > default). Sizes take units: 4096, 512MiB, 1GiB.",
    )
    p.add_argument("--config", metavar="FILE", help="TOML file with any of the settings below")
    for f in fields(ServerConfig):
        default = f.default if f.default is not dataclasses.MISSING else "(computed)"
        flag, text = flag_name(f.name), f"{f.metadata.get('help', '')} [default: {default!r}]"
        if f.type == "bool":
            p.add_argument(flag, dest=f.name, default=None, action="store_const", const="true", help=text)
        else:
            p.add_argument(flag, dest=f.name, default=None, metavar="VALUE", help=text)
    return p


def _read_file(path: str, by_name: Mapping[str, dataclasses.Field]) -> dict[str, object]:
    try:
        with open(path, "rb") as fh:
            table = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    unknown = sorted(set(table) - set(by_name))
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown} in {path}; valid: {sorted(by_name)}")
    return {k: _coerce(by_name[k], v, path) for k, v in table.items()}


def load_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> ServerConfig:
    env = os.environ if env is None else env
    args = build_arg_parser().parse_args(argv)
    by_name = {f.name: f for f in fields(ServerConfig)}
    values: dict[str, object] = _read_file(args.config, by_name) if args.config else {}
    for name, f in by_name.items():
        raw = env.get(env_name(name))
        if raw is not None:
            values[name] = _coerce(f, raw, env_name(name))
    for name, f in by_name.items():
        raw = getattr(args, name)
        if raw is not None:
            values[name] = _coerce(f, raw, flag_name(name))
    return validate(ServerConfig(**values))  # type: ignore[arg-type]  # each value was coerced to its field
