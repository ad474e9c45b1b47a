"""vLLM's identity of the blocks a save stores (kvstore.origins.BlockOrigin), for the daemon's vLLM-format KV events.

The daemon names the blocks it holds, in the events a router indexes (kvstore/server/kv_events), by vLLM's own
block hashes only if it is told them: our keys are our chained hashes (keys.py), a router's are vLLM's. The
scheduler side knows both for every key it asks the worker to save: key k covers vLLM blocks k*g .. k*g+g-1
(g = blocks_per_key), whose hashes vLLM keeps in Request.block_hashes, and their tokens. It puts them in the
SaveJob; the worker sends them (Client.annotate) on its commit thread right before the Store or Commit of the
same keys, on the same client, so the daemon has them when it publishes the blocks' stored event.

Only where vLLM's hashes are blocks of the KV block size and bytes (vLLM 0.32/0.33's sha256 hashes; a hybrid
model's finer hash blocks and the 64-bit int form are left out: those keys are published under our key,
flagged), and only while the daemon publishes such events (Health.kv_events): otherwise nothing is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.origins import BlockOrigin
from kvstore_connector.request_attrs import lora_name, num_tokens

__all__ = ["save_origins"]


def save_origins(request: Any, tokens: Sequence[int], first: int, full: int, blocks_per_key: int,
                 block_size: int) -> tuple[BlockOrigin, ...]:
    """The identities of keys first .. full-1 of `request` (their tokens: tokens[first*t : full*t], t =
    blocks_per_key * block_size), one per key; () when vLLM's hashes cannot name them (module docstring), or
    fewer than full - first when vLLM has not hashed the last ones yet."""
    hashes = getattr(request, "block_hashes", None)
    g, t = blocks_per_key, blocks_per_key * block_size
    if not hashes or not isinstance(hashes[0], bytes) or len(hashes) * block_size > num_tokens(request):
        return ()
    lora = lora_name(request)
    out = []
    for k in range(first, min(full, len(hashes) // g)):
        parent = hashes[k * g - 1] if k else None
        out.append(BlockOrigin.of(hashes[k * g:(k + 1) * g], parent, tokens[k * t:(k + 1) * t], block_size, lora))
    return tuple(out)
