"""What the vLLM scheduler tests (tests/vllm_sched/test_vllm_scheduler*.py) store and compare: the prompt they
send, the keys a daemon holds for the harness's namespace, the chained keys of a prompt, and the exact bytes
one stored block holds after the fake model runner's forward.
"""

from __future__ import annotations

import torch

from kvstore_connector.keys import KeyChain, chain_root
from kvstore_connector.namespace import namespace_for
from kvstore.client import Client

from .harness import BLOCK, HEAD_DIM, HEADS, Harness, kv_value

__all__ = ["PROMPT", "daemon_keys", "expected_key_bytes", "chain_keys"]

PROMPT = [(11 * i + 3) % 1000 + 10 for i in range(100)]


def daemon_keys(h: Harness, address: str) -> list[bytes]:
    with Client(address) as c:
        return [k.key for k in c.keys(namespace_for(h.sched_side.spec))]


def expected_key_bytes(tokens: list[int], key: int, layers: range, tp_rank: int = 0, tp: int = 1) -> bytes:
    """One stored block (blocks_per_key=1) as a forward writes it on TP rank `tp_rank` of `tp`: per layer of the
    stage, K then V, that rank's heads."""
    pos = torch.arange(key * BLOCK, (key + 1) * BLOCK)
    tok = torch.tensor(tokens[key * BLOCK:(key + 1) * BLOCK])
    return b"".join(kv_value(li, kv, pos, tok, tp_rank)[:, None, None].expand(-1, HEADS // tp, HEAD_DIM)
                    .contiguous().numpy().tobytes() for li in layers for kv in range(2))


def chain_keys(n: int, prompt: list[int]) -> list[bytes]:
    return KeyChain(BLOCK, 0, chain_root(0)).extend(prompt)[:n]
