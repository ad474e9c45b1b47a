"""The docs hold: every command they show parses, every link lands, the README stays a front page, and
every package's module map names its modules.

Why: README.md and docs/*.md are the first thing a newcomer runs, and a renamed flag or a moved page breaks
them silently. So every command shown (in code blocks and in inline code) that invokes one of our entry points
is checked against the program itself: `kvstore [SUBCOMMAND]` and `kvstore-server` through the console
scripts pyproject.toml declares, `python -m kvstore...` / `python -m bench.<x>` as modules, each run with
`--help` in a subprocess (exit 0), and every flag the doc uses must appear in that help; `make <target>` must be
a target of the Makefile. The --help runs are collected first and run in parallel, once per distinct command.
"""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOC_FILES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md"]
README_MAX_CHARS = 10_000

SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FLAG = re.compile(r"^--?[A-Za-z][\w-]*$")
ENV_ASSIGN = re.compile(r"^[A-Z_][A-Z0-9_]*=")


@dataclass(frozen=True)
class Command:
    """One command a doc shows: where, its words, and which of our entry points it invokes."""

    where: str
    words: tuple[str, ...]
    kind: str  # "make", "script" (a console script of pyproject.toml) or "module" (python -m)

    @property
    def prog(self) -> str:
        return self.words[0].rsplit("/", 1)[-1] if self.kind != "module" else self.words[2]

    @property
    def args(self) -> list[str]:
        return list(self.words[3:] if self.kind == "module" else self.words[1:])

    @property
    def flags(self) -> list[str]:
        return sorted({w.split("=", 1)[0] for w in self.args if FLAG.match(w.split("=", 1)[0])})


@dataclass(frozen=True)
class CliInfo:
    """What the kvstore CLI's top-level help says: its subcommands, and which global flags take a value."""

    subcommands: frozenset[str]
    value_flags: frozenset[str]

    @classmethod
    def parse(cls, help_text: str) -> CliInfo:
        section = help_text.split("positional arguments:", 1)[-1].split("\n\n", 1)[0]
        subs = frozenset(m.group(1) for m in re.finditer(r"^ {4}(\w[\w-]*)", section, re.M))
        values = frozenset(re.findall(r"\[(--[\w-]+) [A-Z_]+\]", help_text))
        return cls(subs, values)

    def subcommand(self, args: list[str]) -> str | None:
        """The first positional word (written `a|b|c` for alternatives), past global flags and their values."""
        i = 0
        while i < len(args):
            word = args[i]
            if not word.startswith("-"):
                return word
            i += 2 if word in self.value_flags else 1
        return None


@cache
def _scripts() -> dict[str, str]:
    """Console scripts from pyproject.toml: name -> 'module:function'."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return dict(data["project"]["scripts"])


def _script_argv(name: str, args: list[str]) -> tuple[str, ...]:
    """Run a console script the way its installed wrapper does, under this interpreter."""
    module, func = _scripts()[name].split(":")
    code = f"import sys; from {module} import {func} as f; sys.argv[0] = {name!r}; sys.exit(f())"
    return ("-c", code, *args)


def _help_argv(cmd: Command, cli: CliInfo) -> tuple[str, ...]:
    if cmd.kind == "module":
        return ("-m", cmd.prog, "--help")
    sub = cli.subcommand(cmd.args) if cmd.prog == "kvstore" else None
    return _script_argv(cmd.prog, [sub.split("|")[0], "--help"] if sub else ["--help"])


def _split_segments(line: str) -> list[list[str]]:
    """A shell line -> the word lists of its commands (split at &&, ; and a spaced |); [] if unparsable."""
    out = []
    for segment in re.split(r"\s(?:&&|;|\|\|?)\s", line):
        try:
            words = shlex.split(segment, comments=True)
        except ValueError:  # an unclosed quote (a JSON argument over several lines): not one of ours
            continue
        words = [w.strip("[]") for w in words if w not in ("...", "[", "]")]
        while words and ENV_ASSIGN.match(words[0]):
            words.pop(0)
        if words:
            out.append(words)
    return out


def _classify(where: str, words: list[str]) -> Command | None:
    """The Command for a word list that invokes one of our entry points, else None."""
    prog = words[0].rsplit("/", 1)[-1]
    if prog == "make":
        return Command(where, tuple(words), "make")
    if prog in ("kvstore", "kvstore-server"):
        return Command(where, tuple(words), "script")
    if re.fullmatch(r"python3?(\.\d+)?", prog) and len(words) >= 3 and words[1] == "-m":
        if words[2].split(".")[0] in ("kvstore", "bench", "kvstore_connector", "connector"):
            return Command(where, tuple(words), "module")
    return None


def _commands_in(path: Path) -> list[Command]:
    text = path.read_text()
    rel = path.relative_to(ROOT).as_posix()
    found: list[Command] = []

    def line_of(pos: int) -> int:
        return text.count("\n", 0, pos) + 1

    fenced_spans = []
    for m in FENCE.finditer(text):
        fenced_spans.append(m.span())
        if m.group(1).lower() not in SHELL_LANGS:
            continue
        start = line_of(m.start(2))
        lines = m.group(2).split("\n")
        for i in range(len(lines)):
            # a continued line is checked once, where it starts, with its continuation
            if i and lines[i - 1].endswith("\\"):
                continue
            j = i
            while lines[j].endswith("\\") and j + 1 < len(lines):
                j += 1
            joined = " ".join(part.removesuffix("\\") for part in lines[i:j + 1])
            for words in _split_segments(joined.strip().removeprefix("$ ")):
                cmd = _classify(f"{rel}:{start + i}", words)
                if cmd is not None:
                    found.append(cmd)
    for m in INLINE.finditer(text):
        if any(a <= m.start() < b for a, b in fenced_spans):
            continue
        for words in _split_segments(m.group(1)):
            cmd = _classify(f"{rel}:{line_of(m.start())} (inline)", words)
            if cmd is not None:
                found.append(cmd)
    return found


def _run_help(argv: tuple[str, ...]) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    return proc.returncode, proc.stdout + proc.stderr


ALL_COMMANDS = [c for path in DOC_FILES for c in _commands_in(path)]


@dataclass
class Helps:
    cli: CliInfo
    cli_rc: int
    cli_out: str
    outputs: dict[tuple[str, ...], tuple[int, str]]

    def __repr__(self) -> str:  # pytest prints it in failures: the help texts themselves are noise there
        return f"Helps({len(self.outputs)} --help outputs)"


@pytest.fixture(scope="module")
def helps() -> Helps:
    """Every distinct --help invocation the docs need, run once each: the kvstore CLI's top level first (it
    says which word is a subcommand), then the rest in parallel."""
    top = _script_argv("kvstore", ["--help"])
    cli_rc, cli_out = _run_help(top)
    cli = CliInfo.parse(cli_out)
    wanted = sorted({_help_argv(c, cli) for c in ALL_COMMANDS if c.kind != "make"} - {top})
    with ThreadPoolExecutor(max_workers=6) as pool:
        outputs = dict(zip(wanted, pool.map(_run_help, wanted)))
    outputs[top] = (cli_rc, cli_out)
    return Helps(cli, cli_rc, cli_out, outputs)


def test_docs_show_commands_of_every_kind() -> None:
    """The extraction finds what the docs obviously show (a broken parser must not pass everything)."""
    progs = {c.prog for c in ALL_COMMANDS}
    assert {"make", "kvstore", "kvstore-server", "bench.replay", "bench.micro", "bench.serve"} <= progs, progs
    readme = [c.words for c in ALL_COMMANDS if c.where.startswith("README.md:")]
    assert ("make", "run") in readme and ("make", "test") in readme


@pytest.mark.parametrize("cmd", ALL_COMMANDS, ids=lambda c: f"{c.where} {' '.join(c.words)[:60]}")
def test_command_parses(cmd: Command, helps: Helps) -> None:
    if cmd.kind == "make":
        makefile = (ROOT / "Makefile").read_text()
        targets = [w for w in cmd.args if not w.startswith("-") and "=" not in w]
        assert targets, f"{cmd.where}: `make` without a target"
        for target in targets:
            assert re.search(rf"^{re.escape(target)}\s*:", makefile, re.M), (
                f"{cmd.where}: `make {target}` is not a target of the Makefile")
        return
    if cmd.prog == "kvstore":
        assert helps.cli_rc == 0, f"`kvstore --help` exited {helps.cli_rc}:\n{helps.cli_out[-2000:]}"
        sub = helps.cli.subcommand(cmd.args)
        for alt in sub.split("|") if sub else ():
            assert alt in helps.cli.subcommands, f"{cmd.where}: `kvstore {alt}` is not a kvstore subcommand"
    argv = _help_argv(cmd, helps.cli)
    rc, out = helps.outputs[argv]
    assert rc == 0, f"{cmd.where}: `{cmd.prog} ... --help` exited {rc}:\n{out[-2000:]}"
    missing = [f for f in cmd.flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", out)]
    assert not missing, f"{cmd.where}: {missing} not in the --help of `{' '.join(cmd.words)}`:\n{out}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces -> hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {_slug(m.group(1).replace("`", "")) for m in re.finditer(r"^#{1,6}\s+(.+)$", text, re.M)}


LINKS = [(path, m.group(1)) for path in DOC_FILES for m in LINK.finditer(FENCE.sub("", path.read_text()))
         if not re.match(r"^[a-z]+:", m.group(1))]


@pytest.mark.parametrize("path,target", LINKS, ids=lambda v: v.name if isinstance(v, Path) else v)
def test_relative_link_lands(path: Path, target: str) -> None:
    file_part, _, anchor = target.partition("#")
    dest = (path.parent / file_part).resolve() if file_part else path
    assert dest.exists(), f"{path.relative_to(ROOT)}: link {target!r} -> {dest} does not exist"
    if anchor and dest.suffix == ".md":
        assert anchor in _anchors(dest), f"{path.relative_to(ROOT)}: no heading #{anchor} in {dest.name}"


def test_readme_is_a_front_page() -> None:
    text = README.read_text()
    assert len(text) <= README_MAX_CHARS, f"README.md has {len(text)} characters (at most {README_MAX_CHARS})"
    for page in ("architecture", "configuration", "security", "peer-tier", "connector", "operations", "benchmarks"):
        assert f"(docs/{page}.md)" in text, f"README.md does not link docs/{page}.md"


REPO_PATH = re.compile(r"^(?:kvstore|connector|bench|tests|deploy|proto|docs)/[\w./-]*$")
BUILT = ("kvstore/_proto",)  # written by the build into the installed package, not in the tree
OUTPUTS = "bench/out/"  # written by the benchmarks when they run; gitignored, so a clean clone has none


def _repo_paths(path: Path) -> list[str]:
    """Repository paths a doc names: inline code that is exactly a path, and the first word of a line in a
    plain code block (the source layout)."""
    text = path.read_text()
    found = []
    for m in FENCE.finditer(text):
        if m.group(1) == "":
            found += [line.split()[0].rstrip(",") for line in m.group(2).split("\n") if line.strip()]
    found += [m.group(1) for m in INLINE.finditer(FENCE.sub("", text))]
    return sorted({p for p in found if REPO_PATH.match(p) and not p.startswith(BUILT)})


PATHS = [(path, p) for path in DOC_FILES for p in _repo_paths(path) if not p.startswith(OUTPUTS)]
OUTPUT_PATHS = [(path, p) for path in DOC_FILES for p in _repo_paths(path) if p.startswith(OUTPUTS)]


@pytest.mark.parametrize("path,named", PATHS, ids=lambda v: v.name if isinstance(v, Path) else v)
def test_named_repository_path_exists(path: Path, named: str) -> None:
    assert (ROOT / named).exists(), f"{path.relative_to(ROOT)} names {named}, which does not exist (moved?)"


@pytest.mark.parametrize("path,named", OUTPUT_PATHS, ids=lambda v: v.name if isinstance(v, Path) else v)
def test_named_benchmark_output_is_written(path: Path, named: str) -> None:
    """A benchmark output a doc names (bench/out/ is gitignored, so it need not exist) is one a bench script
    writes: its file name appears in bench/'s source."""
    name = Path(named).name
    writers = [p for p in (ROOT / "bench").rglob("*.py") if name in p.read_text()]
    assert writers, f"{path.relative_to(ROOT)} names {named}, but no bench/ script writes {name}"


def test_main_settings_table_names_real_settings() -> None:
    """docs/operations.md's table of the main settings (the full list is generated into configuration.md)
    names only settings ServerConfig has."""
    import dataclasses

    from kvstore.server.config import ServerConfig

    text = (ROOT / "docs" / "operations.md").read_text()
    table = text.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    named = [k for cell in re.findall(r"^\| ([^|]+) \|", table, re.M) for k in re.findall(r"`(\w+)`", cell)]
    assert len(named) >= 30, named
    fields = {f.name for f in dataclasses.fields(ServerConfig)}
    assert not [k for k in named if k not in fields], f"not settings: {[k for k in named if k not in fields]}"


def test_connector_page_lists_every_extra_config_key() -> None:
    """docs/connector.md's Config entry names every key of `kv_connector_extra_config` and no other."""
    import dataclasses

    from kvstore_connector.config import ConnectorConfig

    text = (ROOT / "docs" / "connector.md").read_text()
    entry = text.split("- **Config**", 1)[1].split("\n\n", 1)[0].split("\n- ", 1)[0]
    named = set(re.findall(r"`(\w+)`", entry)) - {"kv_connector_extra_config"}
    keys = {f.name for f in dataclasses.fields(ConnectorConfig)}
    values = {"prompt", "all", "off", "auto", "sync", "async", "trim"}  # values the entry quotes, not keys
    assert keys <= named, f"not in docs/connector.md: {sorted(keys - named)}"
    assert named - values <= keys, f"docs/connector.md names keys the connector lacks: {sorted(named - values - keys)}"


def test_make_demo_tour_runs_and_says_cold_and_warm() -> None:
    """`make demo` is the README's first tour: it must run, verify what it read, and print both get rates."""
    proc = subprocess.run([sys.executable, "-m", "bench.demo"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "prefix lookup of the first 40 + 1 unknown key: 40 hits" in lines, proc.stdout
    assert "got 64 blocks, contents verified: True" in lines, proc.stdout
    assert [ln.split(" (")[0].strip() for ln in lines if "get (" in ln] == ["cold get", "warm get"], proc.stdout
    assert any(ln.startswith("stats: 64 blocks, 128 MiB stored of 512 MiB") for ln in lines), proc.stdout


# Module maps -----------------------------------------------------------------------------------------------

PACKAGE_ROOTS = ("kvstore", "kvstore_connector", "connector", "bench")
GENERATED = {"kvstore/_proto"}  # protobuf stubs written by the build


def _packages() -> list[Path]:
    out = []
    for top in PACKAGE_ROOTS:
        for init in sorted((ROOT / top).rglob("__init__.py")):
            pkg = init.parent
            rel = pkg.relative_to(ROOT).as_posix()
            if "__pycache__" not in rel and not any(rel == g or rel.startswith(g + "/") for g in GENERATED):
                out.append(pkg)
    return out


@pytest.mark.parametrize("pkg", _packages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_module_map_is_true(pkg: Path) -> None:
    """The package docstring names each module as `name.py` (and each subpackage as `name/` or by its dotted
    name), and every bare `name.py` it names exists here: a map a newcomer can trust."""
    doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text())) or ""
    rel = pkg.relative_to(ROOT).as_posix()
    modules = {p.name for p in pkg.glob("*.py") if p.name != "__init__.py"}
    subpackages = {p.name for p in pkg.iterdir() if (p / "__init__.py").exists()}
    missing = sorted(m for m in modules if not re.search(rf"(?<![\w/.]){re.escape(m)}", doc))
    dotted = rel.replace("/", ".")
    missing += sorted(f"{s}/" for s in subpackages
                      if not re.search(rf"(?<![\w/.]){re.escape(s)}/", doc) and f"{dotted}.{s}" not in doc)
    stale = sorted(set(re.findall(r"(?<![\w/.])(\w+\.py)\b", doc)) - modules - {"__init__.py"})
    problems = ([f"does not name {missing}"] if missing else []) + ([f"names {stale}, not in {rel}/"] if stale else [])
    assert not problems, f"{rel}/__init__.py's docstring " + "; ".join(problems)


def test_the_vllm_examples_kv_transfer_config_is_valid() -> None:
    """The `vllm serve ... --kv-transfer-config '{...}'` examples of the README and docs/connector.md parse as
    JSON, name the connector's class and no module path (installing kvstore registers it with vLLM:
    kvstore_connector/plugin.py, pyproject's entry point), and their extra config passes the connector's own check
    (a user copies these lines as they are)."""
    import json

    from kvstore_connector.config import ConnectorConfig

    for page in (ROOT / "README.md", ROOT / "docs" / "connector.md"):
        found = re.findall(r"--kv-transfer-config '(\{.*?\})'", page.read_text(), re.S)
        assert len(found) == 1, f"{page.name}: {len(found)} --kv-transfer-config examples"
        cfg = json.loads(found[0])
        assert "kv_connector_module_path" not in cfg, cfg
        source = (ROOT / "kvstore_connector" / "vllm_connector.py").read_text()  # importing it imports vllm
        assert cfg["kv_connector"] == "KVStoreConnector" and "\nclass KVStoreConnector(" in source, cfg
        entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
        assert entry["vllm.general_plugins"] == {"kvstore": "kvstore_connector.plugin:register"}
        assert cfg["kv_role"] == "kv_both" and cfg["kv_load_failure_policy"] == "recompute", cfg
        parsed = ConnectorConfig.from_extra(cfg["kv_connector_extra_config"])
        # no address: the connector dials $KVSTORE_ADDRESS, else the daemon's default socket (kvstore/paths.py),
        # so the example reaches a daemon started with its defaults (tests/install/test_wheel_serve.py)
        assert parsed.address is None and parsed.save == "all", parsed


def _section(text: str, heading: str) -> str:
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end >= 0 else len(text)]


def test_the_readme_quotes_only_figures_of_the_benchmarks_summary() -> None:
    """docs/benchmarks.md opens with its summary table (ranges over the runs it records), and every figure of
    the README's Measured table is one that table holds: no figure in the README that the page does not."""
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert page.split("\n## ", 1)[1].startswith("Summary\n"), "docs/benchmarks.md must open with ## Summary"
    summary = _section(page, "## Summary")
    rows = [line for line in _section(README.read_text(), "## Measured").splitlines() if line.startswith("| ")][2:]
    assert len(rows) >= 8
    number = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)?(?![\w])")
    for row in rows:
        result = row.split("|")[2]
        figures = number.findall(result)
        assert figures, row
        for figure in figures:
            assert re.search(rf"(?<![\w.]){re.escape(figure)}(?![\d])", summary), \
                f"README's Measured quotes {figure} ({row.strip()}), which docs/benchmarks.md's summary does not hold"


ETCD_RULE = "a plain http:// etcd on another host is refused unless allow_insecure_remote = true"


def test_the_plain_http_etcd_rule_is_said_one_way_everywhere() -> None:
    """One rule (kvstore/server/config/security.py check_etcd), one sentence wherever it is stated: the docs,
    the deploy files and the setting's help (docs/configuration.md), and no older variant of it."""
    places = [ROOT / p for p in ("docs/security.md", "docs/configuration.md", "deploy/README.md", "deploy/kvstore.toml",
                                 "deploy/kubernetes/daemonset.yaml")]
    for path in places:
        text = re.sub(r"\s*\n\s*#?\s*", " ", path.read_text()).replace("`", "").lower()
        assert ETCD_RULE in text, f"{path.relative_to(ROOT)} does not state the etcd rule as: {ETCD_RULE}"
    for path in [*DOC_FILES, *places]:
        text = re.sub(r"\s+", " ", path.read_text()).lower()
        assert "protected by tls, tokens or an etcd login unless" not in text, path
