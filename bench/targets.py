"""Targets a benchmark's figures are held to: stated once, checked once, shown next to the figures.

Each target names a field of the benchmark's JSON, a comparison and a bound. `evaluate` gives the JSON's
`targets` object (value, bound, pass per field) and `mark` the PASS/MISS text a table prints beside the figure,
so the table, the JSON and the exit status can never disagree about what was met.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Target", "evaluate", "mark"]

_OPS = {"<=": operator.le, ">=": operator.ge}


@dataclass(frozen=True)
class Target:
    field: str
    op: str      # "<=" or ">="
    bound: float
    source: str  # where the target comes from (an issue), shown in the JSON

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"target {self.field}: op {self.op!r}, use <= or >=")

    def met(self, out: Mapping[str, Any]) -> bool:
        return bool(_OPS[self.op](out[self.field], self.bound))

    def text(self) -> str:
        return f"{self.op} {self.bound:g}"


def evaluate(targets: Sequence[Target], out: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """{field: {"value", "op", "bound", "pass", "source"}} for the JSON."""
    return {t.field: {"value": out[t.field], "op": t.op, "bound": t.bound, "pass": t.met(out), "source": t.source}
            for t in targets}


def mark(targets: Sequence[Target], out: Mapping[str, Any], field: str) -> str:
    """'<= 150 PASS' for the targets on `field` (joined when several), '' when it has none."""
    return "; ".join(f"{t.text()} {'PASS' if t.met(out) else 'MISS'}" for t in targets if t.field == field)
