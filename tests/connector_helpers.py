"""Shared parts of the connector tests (tests/test_connector*.py): a tiny KV layout, per-layer caches, one
block's bytes in the connector's order, a plain Request with vLLM's attribute names, and a scheduler side plus a
worker side sharing a daemon, driven like vLLM's two processes drive them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstore_connector.config import ConnectorConfig
from kvstore_connector.link import StoreLink
from kvstore_connector.namespace import KVLayoutSpec, registration
from kvstore_connector.scheduler import ScheduledRequest, SchedulerSide
from kvstore_connector.worker import WorkerSide

__all__ = ["BS", "LAYERS", "HEADS", "HD", "NBLOCKS", "SPEC", "T", "make_caches", "block_bytes_of", "Req", "Side",
           "prompt_tokens"]

BS, LAYERS, HEADS, HD, NBLOCKS = 4, 3, 2, 8, 64
SPEC = KVLayoutSpec(model="org/tiny", dtype="float16", block_size=BS, num_layers=LAYERS, num_kv_heads=HEADS,
                    head_dim=HD, tp_rank=0, tp_size=1, blocks_per_key=2)
T = SPEC.tokens_per_key  # 8 tokens per stored block



def make_caches(seed: int, shape_fn=lambda: (2, NBLOCKS, BS, HEADS, HD)) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.attn": torch.randn(*shape_fn(), generator=g).to(torch.float16) for i in range(LAYERS)}


def block_bytes_of(caches: dict[str, torch.Tensor], b: int) -> bytes:
    """One vLLM block's bytes in the connector's order: layer by layer, K then V."""
    return b"".join(t[kv, b].numpy().tobytes() for t in caches.values() for kv in range(2))


@dataclass
class Req:
    """The attributes of vLLM's Request that the scheduler side reads."""

    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    output: list[int] = field(default_factory=list)
    max_tokens: int | None = None  # vLLM's Request.max_tokens; None: the request stops on EOS (unpredicted)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output


class Side:
    """One scheduler side and one worker side sharing a daemon, like vLLM's two processes."""

    def __init__(self, address: str, caches: dict[str, torch.Tensor], spec: KVLayoutSpec = SPEC,
                 **extra: object) -> None:
        # async unless a test asks: most tests follow a load through the report vLLM waits for. No claims unless a
        # test asks: a Side whose lookup misses rarely computes what it claimed, and a later Side would wait for
        # it (tests/test_connector_claims.py tests claims)
        self.config = ConnectorConfig.from_extra({"address": address, "blocks_per_key": spec.blocks_per_key,
                                                  "load_mode": "async", "claim_ms": 0, **extra})
        mk = lambda: StoreLink(address, timeout_s=5.0, namespace_spec=lambda _n: registration(spec))  # noqa: E731
        self.sched = SchedulerSide(self.config, spec, mk())
        self.worker = WorkerSide(self.config, spec, mk())
        self.worker.register(caches, NBLOCKS)
        self.caches = caches

    def prefill(self, req: Req, blocks: list[int]) -> None:
        """Schedule the whole prompt in one step (after any load), then run the worker's save."""
        self.sched.track(req)  # vLLM's on_new_request
        plan = self.sched.build([ScheduledRequest(req.request_id, [blocks], True,
                                                  len(req.prompt_token_ids) - req.num_computed_tokens)])
        self.worker.start_loads(plan.loads)
        self.worker.save(plan.saves)
        self.worker.drain()
        req.num_computed_tokens = len(req.prompt_token_ids)

    def close(self) -> None:
        self.worker.close()


def prompt_tokens(n: int, start: int = 0) -> list[int]:
    return [(start + 7 * i) % 1000 for i in range(n)]
