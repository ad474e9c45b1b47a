"""docs/configuration.md is generated from ServerConfig's help; the committed page must be what the generator writes."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields
from pathlib import Path

from kvstore.server.config import SECTIONS, ServerConfig, build_arg_parser
from kvstore.server.config_doc import COMMAND, render

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "configuration.md"


def test_committed_page_is_what_the_generator_writes() -> None:
    committed = PAGE.read_text() if PAGE.exists() else "(missing)"
    assert committed == render(), (
        f"docs/configuration.md is stale: ServerConfig's settings or help changed. Regenerate it with `{COMMAND}` "
        "(from the repository root) and commit the result"
    )


def test_the_documented_command_writes_the_page() -> None:
    r = subprocess.run([sys.executable, "-m", "kvstore.server.config_doc"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 0 and r.stderr == "" and r.stdout == render()


def test_every_setting_is_documented_once_with_env_and_flag() -> None:
    page = render()
    names = [f.name for f in fields(ServerConfig)]
    assert len(names) == 85
    for name in names:
        row = [line for line in page.splitlines() if line.startswith(f"| `{name}` |")]
        assert len(row) == 1, name
        assert f"`KVSTORE_{name.upper()}`<br>`--{name.replace('_', '-')}`" in row[0]
    assert [line[3:] for line in page.splitlines() if line.startswith("## ")] == list(SECTIONS.values())


def test_rows_show_type_default_and_help() -> None:
    rows = {line.split(" | ")[0][3:-1]: line.split(" | ") for line in render().splitlines() if line.startswith("| `")}
    assert rows["arena_bytes"][1:3] == ["size", "`1GiB`"]
    assert rows["disk_segment_bytes"][1:3] == ["size", "`256MiB`"]
    assert rows["disk_wipe"][1:3] == ["bool", "`false`"]
    assert rows["high_watermark"][1:3] == ["float", "`0.95`"]
    assert rows["policy"][1:3] == ["string", '`"lru"`'] and rows["policy"][4] == "eviction policy: lru, s3fifo |"
    assert rows["disk_codec"][4].startswith("default disk compression: none, zstd, zstd-shuffle2")
    assert rows["node_id"][2] == "the host name"
    assert rows["disk_admission"][4].startswith("which blocks get a disk copy: always \\| seen:N")  # pipes escaped


def test_every_setting_has_a_section_and_help_and_prefixes_match_sections() -> None:
    prefixes = {"disk_": "disk", "peer_": "peer", "etcd_": "peer", "tls_": "security", "tenant_": "tenancy",
                "metrics_": "metrics", "arena_": "arena", "log_": "node"}
    for f in fields(ServerConfig):
        assert f.metadata["section"] in SECTIONS and f.metadata["help"].strip(), f.name
        for prefix, section in prefixes.items():
            if f.name.startswith(prefix):
                assert f.metadata["section"] == section, f.name
    help_text = build_arg_parser().format_help()
    assert all(f"--{f.name.replace('_', '-')}" in help_text for f in fields(ServerConfig))
