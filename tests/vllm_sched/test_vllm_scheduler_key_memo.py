"""The key memo (kvstore_connector/key_memo.py) under vLLM 0.33's real v1 Scheduler (CPU), its real Requests and block
hasher (SHA-256, block size 16), and a real daemon: an agent session's turns, each prompt the last one plus its
output plus new tokens, and a sub-agent forking from the first turn. Every key the daemon holds is the key hashed
from scratch, and from the second turn on only the new chunks are hashed.

blocks_per_key=1, block size 16: one key per vLLM block.
"""

from __future__ import annotations

import pytest

from kvstore_connector.key_memo import KeyMemo
from tests.key_hashes import count_key_hashes

from .harness import BLOCK, Harness
from .stored import PROMPT, chain_keys, daemon_keys


@pytest.fixture
def digests(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the connector's key chain hashes (vLLM hashes its blocks with SHA-256 here)."""
    return count_key_hashes(monkeypatch)


def test_session_turns_hash_only_their_new_chunks_and_store_the_same_keys(daemon, model_dir, digests) -> None:
    h = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1})
    sched = h.sched_side._sched
    assert sched is not None and isinstance(sched.key_memo, KeyMemo)  # one KV cache group, SHA-256
    r1 = h.add("turn1", PROMPT)
    h.run()
    roots = digests[0] - 100 // BLOCK  # the chain's hashes besides its 6 chunk keys: its roots (lookup, hints)
    assert roots >= 1 and len(sched.key_memo) == 6
    turn2 = PROMPT + list(r1.output_token_ids) + [(5 * i + 17) % 900 + 20 for i in range(60)]  # 162 tokens
    digests[0] = 0
    h.add("turn2", turn2)
    h.run()
    assert digests[0] == (162 // BLOCK - 6) + roots  # 4 new chunks
    fork = PROMPT[:80] + [(3 * i + 1) % 700 + 30 for i in range(40)]  # 5 whole chunks of turn 1, then its own
    digests[0] = 0
    h.add("fork", fork)
    h.run()
    assert digests[0] == (120 // BLOCK - 5) + roots
    stored = set(daemon_keys(h, daemon.address))
    assert stored == set(chain_keys(10, turn2)) | set(chain_keys(7, fork))
    assert len(sched.key_memo) == 10 + 2
    h.close()
