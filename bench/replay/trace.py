"""Trace records: load and write the Mooncake JSONL format, and say which blocks of a request are cacheable.

One JSON object a line: `timestamp` (ms from the start), `input_length`, `output_length` (tokens), `hash_ids`
(one id per 512-token block of the prompt, the last one usually partial; equal ids at the same position mean a
shareable prefix). Optional `session_id` and `agent` (written by the AgentX generator) group the calls of one
agentic task; files without them are treated as independent requests. Unknown fields are ignored so that any
file in this format replays.

Why a `Convention`: the last block of a prompt is usually partial. vLLM (and so a connector) only caches full
blocks, so by default only `input_length // 512` leading blocks are keyed, looked up and stored. The dataset
README counts every hash id as a block (its infinite-cache hit rate 0.366 is over all ids); `KEEP_PARTIAL`
reproduces that convention.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

__all__ = ["BLOCK_TOKENS", "Convention", "Hint", "Request", "load_trace", "write_trace", "cut_trace"]

BLOCK_TOKENS = 512
DEFAULT_TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "conversation_trace.jsonl"


class Convention(Enum):
    """Which blocks of a prompt are cacheable."""

    FULL_BLOCKS = "full"  # input_length // 512 leading blocks (what vLLM caches)
    KEEP_PARTIAL = "all"  # every hash id, the partial last block included (the dataset README's count)


@dataclass(frozen=True, slots=True)
class Hint:
    """An agent runtime's hint on one chain (bench/replay/hints.py says when it is sent and how it is modelled).

    action: a kvstore.hint_vocab.HintAction value; ids: the chain's cacheable hash ids from its start (keys are
    chained, so a tail needs its head); start: the first hinted position; ttl_s: trace seconds (0: none);
    before: sent before the request it is attached to (Prefetch: the tool returned), else after it."""

    action: str
    ids: tuple[int, ...]
    start: int = 0
    ttl_s: float = 0.0
    before: bool = False


@dataclass(frozen=True, slots=True)
class Request:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: int | str | None = None
    agent: int = 0
    hints: tuple[Hint, ...] = ()  # what the agent runtime says around this call (AgentXParams(hints=True))

    def cacheable_ids(self, convention: Convention = Convention.FULL_BLOCKS) -> tuple[int, ...]:
        if convention is Convention.KEEP_PARTIAL:
            return self.hash_ids
        return self.hash_ids[: self.input_length // BLOCK_TOKENS]

    def hit_tokens(self, hit_blocks: int) -> int:
        """Tokens served from cache when `hit_blocks` leading blocks hit (a partial last block holds fewer)."""
        return min(hit_blocks * BLOCK_TOKENS, self.input_length)


def _parse(line: str, where: str) -> Request:
    try:
        obj = json.loads(line)
        hints = tuple(Hint(str(h["action"]), tuple(int(i) for i in h["ids"]), int(h.get("start", 0)),
                           float(h.get("ttl_s", 0.0)), bool(h.get("before", False))) for h in obj.get("hints", ()))
        return Request(int(obj["timestamp"]), int(obj["input_length"]), int(obj["output_length"]),
                       tuple(int(h) for h in obj["hash_ids"]), obj.get("session_id"), int(obj.get("agent", 0)),
                       hints)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{where}: not a trace record ({exc!r}); expected timestamp, input_length, "
                         "output_length and hash_ids") from exc


def load_trace(path: str | Path, *, limit: int | None = None, window_s: float | None = None) -> list[Request]:
    """Requests in arrival order (stable for equal timestamps); `limit` / `window_s` keep a leading part."""
    out: list[Request] = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                out.append(_parse(line, f"{path}:{n}"))
    out.sort(key=lambda r: r.timestamp_ms)
    return cut_trace(out, limit=limit, window_s=window_s)


def cut_trace(requests: Sequence[Request], *, limit: int | None = None, window_s: float | None = None) -> list[Request]:
    """The leading part of an arrival-ordered trace: the first `window_s` seconds, then the first `limit`."""
    out = list(requests)
    if window_s is not None and out:
        end = out[0].timestamp_ms + window_s * 1000
        out = [r for r in out if r.timestamp_ms < end]
    return out[:limit] if limit is not None else out


def write_trace(path: str | Path, requests: Iterable[Request]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for r in requests:
            obj: dict[str, object] = {"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                      "output_length": r.output_length, "hash_ids": list(r.hash_ids)}
            if r.session_id is not None:
                obj["session_id"] = r.session_id
                obj["agent"] = r.agent
            if r.hints:
                obj["hints"] = [{"action": h.action, "ids": list(h.ids), "start": h.start, "ttl_s": h.ttl_s,
                                 "before": h.before} for h in r.hints]
            fh.write(json.dumps(obj, separators=(",", ":")) + "\n")
