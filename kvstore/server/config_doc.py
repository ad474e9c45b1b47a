"""Writes docs/configuration.md from ServerConfig's fields, so the page can never disagree with the daemon.

    python -m kvstore.server.config_doc > docs/configuration.md

Every key is listed under its section with its type, default, environment variable, flag and help text, all
read from the field and its metadata (kvstore/server/config/settings.py). tests/test_config_doc.py fails when
the committed page differs from what this writes.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import fields

from kvstore.server.config import SECTIONS, ServerConfig
from kvstore.server.config.loader import env_name, flag_name

__all__ = ["render", "main", "COMMAND"]

COMMAND = "python -m kvstore.server.config_doc > docs/configuration.md"

_INTRO = f"""# Configuration

<!-- Generated from ServerConfig's help by `{COMMAND}`; do not edit by hand. -->

`kvstore-server` has one typed config (`kvstore/server/config/`). Every setting below is at once:

- a key of the TOML file given by `--config FILE` (`arena_bytes = "4GiB"`),
- an environment variable (`KVSTORE_ARENA_BYTES=4GiB`),
- a command-line flag (`--arena-bytes 4GiB`; a boolean flag takes no value).

Precedence: flag > environment > file > default. Sizes (type `size`) take units: `4096`, `512MiB`, `1GiB`
(also kB/MB/GB, powers of ten). An unknown key in the file, a value of the wrong type or a value a rule
refuses stops the daemon before it creates anything (exit status 2), with a message that names the setting,
the value and what would be accepted. `kvstore-server --help` prints the same list.
"""


def _type(f: dataclasses.Field) -> str:
    if f.name.endswith("_bytes"):
        return "size"
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    return {"str": "string"}.get(kind, kind)


def _size(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _default(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING:
        return f.metadata.get("default_doc") or "(computed at start)"
    value = f.default
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int) and f.name.endswith("_bytes"):
        return f"`{_size(value)}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`"


def _cell(text: str) -> str:
    """Table-safe: pipes escaped; <placeholders> escaped outside `code` spans (inside, markdown shows them)."""
    parts = text.replace("|", "\\|").replace("\n", " ").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def render() -> str:
    """The whole page, as the committed docs/configuration.md must read."""
    by_section: dict[str, list[dataclasses.Field]] = {name: [] for name in SECTIONS}
    for f in fields(ServerConfig):
        by_section[f.metadata["section"]].append(f)
    out = [_INTRO]
    out.append("Sections: " + ", ".join(f"[{title}](#{_anchor(title)})" for title in SECTIONS.values()) + ".\n")
    for section, title in SECTIONS.items():
        out.append(f"## {title}\n")
        out.append("| Key | Type | Default | Environment / flag | Meaning |")
        out.append("|---|---|---|---|---|")
        for f in by_section[section]:
            where = f"`{env_name(f.name)}`<br>`{flag_name(f.name)}`"
            out.append(f"| `{f.name}` | {_type(f)} | {_cell(_default(f))} | {where} | {_cell(f.metadata['help'])} |")
        out.append("")
    return "\n".join(out)


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -")
    return kept.replace(" ", "-")


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
