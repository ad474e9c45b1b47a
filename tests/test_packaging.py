"""What `pip install kvstore` puts in site-packages: kvstore and kvstore_connector, typed; never bench/, tests/ or
the checkout's connector/ (the deprecated alias of the old import name: the wheel claims no generic name).

bench/ is a development tool run from a checkout (`python -m bench.x`, cwd on sys.path; the editable install
of `make setup` also puts the checkout on sys.path); `kvstore_connector` ships because vLLM loads the connector
from it (the plugin entry point registers it with vLLM's connector factory). Shipped code must therefore never import bench or tests: a wheel install
would fail at that import. The last test builds the real wheel (about 10 s) and reads its file list.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ["kvstore", "kvstore_connector"]
NOT_SHIPPED = {"bench", "tests"}


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as fh:
        return tomllib.load(fh)


def test_the_wheel_packages_are_kvstore_and_kvstore_connector_only() -> None:
    assert _pyproject()["tool"]["scikit-build"]["wheel"]["packages"] == SHIPPED


def test_every_shipped_package_is_marked_typed() -> None:
    assert [p for p in SHIPPED if not (ROOT / p / "py.typed").is_file()] == []


def _imported_tops(path: Path) -> set[str]:
    tops: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            tops.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return tops


def test_shipped_code_never_imports_bench_or_tests() -> None:
    files = [f for p in SHIPPED for f in sorted((ROOT / p).rglob("*.py"))]
    assert len(files) > 50   # the walk really found the sources
    offenders = {str(f.relative_to(ROOT)): sorted(_imported_tops(f) & NOT_SHIPPED) for f in files}
    assert {f: tops for f, tops in offenders.items() if tops} == {}


def test_the_built_wheel_holds_kvstore_and_kvstore_connector_typed_and_no_bench(tmp_path: Path) -> None:
    # a build directory of its own: the checkout's build/ belongs to the editable install
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(tmp_path / "w"),
                        "-C", f"build-dir={tmp_path / 'build'}"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    (wheel,) = (tmp_path / "w").glob("kvstore-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    version = _pyproject()["project"]["version"]
    assert {n.split("/")[0] for n in names} == {*SHIPPED, f"kvstore-{version}.dist-info"}
    assert {"kvstore/py.typed", "kvstore_connector/py.typed", "kvstore_connector/vllm_connector.py",
            "kvstore/testing/__init__.py", "kvstore/_proto/kvstore_pb2.py"} <= set(names)
    assert [n for n in names if n.startswith("kvstore/_native/_copy.") and n.endswith(".so")] != []
    # vLLM's plugin entry point: installing the wheel registers the connector (kvstore_connector/plugin.py)
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[vllm.general_plugins]\nkvstore = kvstore_connector.plugin:register" in text, text


def test_the_dockerfile_and_the_extras_match_what_the_readme_says_is_tested() -> None:
    """deploy/docker/Dockerfile cannot be built here (no base-image registry); what can be checked is that it
    extends the vLLM the README's table names, installs the wheel built from `make dist`'s sdist with a CUDA
    extra pyproject defines, and that the CUDA extras name the cupy of their CUDA major version."""
    import re

    extras = _pyproject()["project"]["optional-dependencies"]
    assert extras["cuda12"] == ["cupy-cuda12x>=13"] and extras["cuda13"] == ["cupy-cuda13x>=14"]
    docker = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    readme = (ROOT / "README.md").read_text()
    (vllm,) = re.findall(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v([\d.]+)$", docker, flags=re.M)
    assert re.search(rf"^\| vLLM \| {re.escape(vllm)};", readme, flags=re.M), vllm
    (extra,) = re.findall(r"^ARG CUDA_EXTRA=(\w+)$", docker, flags=re.M)
    assert extra in extras and f"`{extra}`" in readme
    assert "COPY kvstore-*.tar.gz /src/" in docker and "pip wheel --no-deps -w /wheels /src/kvstore-*.tar.gz" in docker
    assert '"${whl}[${CUDA_EXTRA}]"' in docker
    makefile = (ROOT / "Makefile").read_text()
    assert "$(PY) -m build -o $(DIST) ." in makefile and "DIST        ?= build/dist" in makefile
