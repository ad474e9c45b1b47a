"""Tests that need a real component that is installed, not built: skipped on a developer's machine without it,
FAILED under CI.

Why: a skip that hides a missing install step is a green lie. `make setup` installs etcd-server and the
`ucx` extra; the conversation trace lives in ../shared/data beside the checkout. CI (.ci/run) sets
KVSTORE_REQUIRE_ALL=1, under which a test whose component is missing fails at setup with a message saying
how to install it; without the variable it is skipped, with the same message.

Use `needs(...)` as a mark (a decorator, `pytestmark`, `pytest.param(..., marks=...)`); conftest.py turns an
unmet one into the skip or the failure. Inside a test or fixture, `missing(...)` does the same at once.
Skips that depend on what the machine IS rather than on what was installed (it has CUDA, it is not root,
the kernel refuses a mount) stay plain skips.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

__all__ = ["REQUIRE_ALL_ENV", "require_all", "needs", "missing"]

REQUIRE_ALL_ENV = "KVSTORE_REQUIRE_ALL"


def require_all() -> bool:
    """True under CI: every component must be there."""
    return os.environ.get(REQUIRE_ALL_ENV, "") not in ("", "0")


def needs(present: bool, what: str, install: str) -> pytest.MarkDecorator:
    """Mark a test that needs `what`; `install` says how to get it. Nothing happens when `present`."""
    return pytest.mark.needs(present=present, what=what, install=install)


def missing(what: str, install: str) -> NoReturn:
    """Skip the running test because `what` is missing, or fail it under KVSTORE_REQUIRE_ALL=1."""
    msg = f"{what} missing: {install}"
    if require_all():
        pytest.fail(f"{msg} ({REQUIRE_ALL_ENV}=1: CI needs every component; a developer may unset it to skip)",
                    pytrace=False)
    pytest.skip(msg)
