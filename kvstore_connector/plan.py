"""What the scheduler side tells the worker side each step: small, picklable value objects.

vLLM ships the connector metadata from the scheduler process to every worker each step, so it carries only
keys and block ids; the worker owns the bytes. `block_ids` of a job holds one list per KV cache group (one for
a model without hybrid groups), each flat, ``blocks_per_key`` entries per key in key order. An entry of -1 is a
block the worker must not touch: already in vLLM's own prefix cache (possibly shared with other requests),
which happens when a hit starts inside a stored block; or, in a sliding-window or chunked-local group, a block
vLLM does not keep (a load) or one this group does not store (a save, see kvstore_connector/groups.py). A load copies
every key of a group with at least one block to fill; a save stores a group's key only when all its blocks are
there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.origins import BlockOrigin

__all__ = ["LoadJob", "SaveJob", "StepPlan"]


@dataclass(frozen=True)
class LoadJob:
    """Copy the stored blocks ``keys`` into vLLM blocks ``block_ids``. Asynchronous: report ``req_id`` as
    received. Synchronous (``sync``): the request is scheduled in this very step, so the copy completes in
    start_load_kv, before the forward reads the blocks, and is not reported (vLLM is not waiting for it)."""

    req_id: str
    cache_salt: str | None  # the worker derives its own rank's namespace from it
    keys: list[bytes]
    block_ids: list[list[int]]  # per KV cache group
    sync: bool = False
    # > 0: some keys are another scheduler's to save (kvstore_connector/claims.py): wait up to this long for them,
    # load the leading keys that came and report the rest failed
    wait_s: float = 0.0


@dataclass(frozen=True)
class SaveJob:
    """Store vLLM blocks ``block_ids`` under ``keys`` (keys already present are skipped by the daemon).
    ``release``: a finished request's partial last block (kvstore_connector/tails.py): vLLM holds the request's blocks
    until the worker reports it sent, which it does once it has gathered them, whatever the save's fate."""

    req_id: str
    cache_salt: str | None  # the worker derives its own rank's namespace from it
    keys: list[bytes]
    block_ids: list[list[int]]  # per KV cache group
    release: bool = False
    # vLLM's identity of the first len(origins) keys, sent to the daemon before their put (origins.py); ()
    # while the daemon publishes no vLLM-format events
    origins: tuple[BlockOrigin, ...] = ()


@dataclass
class StepPlan:
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.loads or self.saves)
