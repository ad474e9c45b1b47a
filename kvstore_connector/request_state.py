"""What the scheduler side keeps per request, and what it reads of each scheduled request: plain values.

Apart from kvstore_connector/scheduler.py so that its mixin kvstore_connector/scheduler_tails.py can name them without importing
the scheduler side back (each module's imports point one way: tests/test_import_graph.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvstore_connector.keys import KeyChain
from kvstore_connector.tails import Tail

__all__ = ["ReqState", "ScheduledRequest"]


@dataclass(frozen=True)
class ScheduledRequest:
    """One request in this step's scheduler output: its block tables, one per KV cache group (whole, or this
    step's additions)."""

    req_id: str
    block_ids: list[list[int]] | None
    is_full_table: bool
    num_scheduled_tokens: int


@dataclass
class ReqState:
    request: Any
    namespaces: list[str]       # one per shard: pipeline stage x TP rank x KV cache group (`_names`)
    salt: str | None
    chain: KeyChain
    root: bytes                 # the chain's root (seed, LoRA adapter, multimodal hashes)
    memo: bool                  # its keys may come from and go to the key memo (no multimodal input, no embeddings)
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    stored_keys: int = 0        # keys known to be in the store (lookup answer or saved)
    lookup_keys: int | None = None  # remembered lookup answer until scheduled
    load_skip_blocks: int = 0   # leading blocks of the first loaded key already in vLLM's prefix cache
    local_tokens: int = 0       # vLLM's own prefix-cache hit at the last lookup (block aligned)
    loading: tuple[int, list[list[int]]] | None = None  # in-flight load: (first key, its job's block ids)
    pending_keys: int = 0       # of lookup_keys, those another scheduler claimed and is saving (kvstore_connector/claims.py)
    fetch_keys: int = 0         # the remembered lookup's hit keys past vLLM's own cache not in this node's RAM
    lookup_tail: Tail | None = None  # the remembered lookup's partial last block (kvstore_connector/tails.py)
    tail_saved: bool = False    # its final partial last block is saved (or asked for)
    missed: bool = False        # a miss cause is counted (or being explained) for this request
    names_tenant: str | None = None  # the tenant `namespaces` were built for (None: not built yet)
    sync_builds: int = 0        # a synchronous load's `loading` outlives this many builds (its failures
    #                             reach update_connector_output after the step it ran in, which with async
    #                             scheduling follows the next build)
