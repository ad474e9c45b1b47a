"""The key memo (kvstore_connector/key_memo.py): keys found by vLLM's block hashes equal the keys hashed from scratch,
byte for byte, and only the new chunks of a new turn are hashed; every case where a hash may not stand for a
prefix keeps the memo out. The requests carry block hashes made the way vLLM makes them (a chain over blocks of
the KV block size); tests/vllm_sched/test_vllm_scheduler_key_memo.py runs the same through vLLM's own scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from bench.scheduler_keys import block_hash_chain
from kvstore_connector.config import ConnectorConfig
from kvstore_connector.key_memo import KeyMemo
from kvstore_connector.keys import KeyChain, chain_root
from kvstore_connector.link import StoreLink
from kvstore_connector.scheduler import SchedulerSide
from tests.connector_helpers import BS, SPEC, T, prompt_tokens
from tests.key_hashes import count_key_hashes


@dataclass
class HashedReq:
    """vLLM's Request as the scheduler side reads it, with its block hashes."""

    request_id: str
    prompt_token_ids: list[int]
    block: int = BS
    cache_salt: str | None = None
    mm_features: list = field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids

    @property
    def block_hashes(self) -> list[bytes]:
        return block_hash_chain(self.prompt_token_ids, self.block, self.cache_salt or "")


def side(memo: KeyMemo | None) -> SchedulerSide:
    """A scheduler side whose daemon is absent: lookups answer nothing, keys are still made."""
    cfg = ConnectorConfig.from_extra({"address": "/nonexistent/kvstore.sock", "blocks_per_key": 2})
    return SchedulerSide(cfg, SPEC, StoreLink("/nonexistent/kvstore.sock", timeout_s=0.2), key_memo=memo)


def scratch(tokens: list[int], lora: str | None = None) -> list[bytes]:
    return KeyChain(T, 0, chain_root(0, lora_name=lora)).extend(tokens)


@pytest.fixture
def digests(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many chunk keys the chain hashes (xxh3-128 calls of kvstore_connector/keys.py)."""
    return count_key_hashes(monkeypatch)


def keys_of(s: SchedulerSide, req: HashedReq) -> list[bytes]:
    return s._extend(s._state(req), req.prompt_token_ids)


def counted(digests: list[int], s: SchedulerSide, req: HashedReq) -> tuple[list[bytes], int]:
    """The request's keys, and how many hashes making them took (its chain's root is one)."""
    digests[0] = 0
    keys = keys_of(s, req)
    return keys, digests[0]


def test_a_new_turn_takes_the_seen_keys_from_the_memo_and_hashes_only_its_new_chunks(digests: list[int]) -> None:
    memo = KeyMemo()
    s = side(memo)
    turn1 = prompt_tokens(100, start=1)                  # 12 chunks of 8 tokens
    turn2 = turn1 + prompt_tokens(37, start=500)          # 17 chunks
    turn3 = turn2 + prompt_tokens(20, start=700)          # 19 chunks
    fork = turn1[:60] + prompt_tokens(30, start=900)      # a sub-agent forks after 7 whole chunks: 11 chunks
    want = {name: scratch(t) for name, t in (("t1", turn1), ("t2", turn2), ("t3", turn3), ("f", fork))}
    assert counted(digests, s, HashedReq("t1", turn1)) == (want["t1"], 12 + 1)
    assert len(memo) == 12
    assert counted(digests, s, HashedReq("t2", turn2)) == (want["t2"], 5 + 1)
    assert counted(digests, s, HashedReq("t3", turn3)) == (want["t3"], 2 + 1)
    assert len(memo) == 19
    assert counted(digests, s, HashedReq("f", fork)) == (want["f"], 4 + 1)


def test_without_a_memo_every_key_is_hashed(digests: list[int]) -> None:
    s = side(None)
    turn = prompt_tokens(100, start=1)
    want = scratch(turn)
    keys_of(s, HashedReq("a", turn))
    assert counted(digests, s, HashedReq("b", turn)) == (want, 12 + 1)


def test_the_cache_salt_changes_vllms_hashes_not_our_keys(digests: list[int]) -> None:
    s = side(KeyMemo())
    turn = prompt_tokens(64, start=3)
    want = scratch(turn)
    keys_of(s, HashedReq("a", turn, cache_salt="alice"))
    assert counted(digests, s, HashedReq("b", turn, cache_salt="bob")) == (want, 8 + 1)


def test_another_root_is_a_miss_and_multimodal_requests_stay_out(digests: list[int]) -> None:
    memo = KeyMemo()
    s = side(memo)
    turn = prompt_tokens(64, start=3)
    want_lora = scratch(turn, lora="adapter")
    keys_of(s, HashedReq("a", turn))
    lora = HashedReq("b", turn)
    lora.lora_request = type("Lora", (), {"lora_name": "adapter"})()  # type: ignore[attr-defined]
    assert counted(digests, s, lora) == (want_lora, 8 + 1)  # the same hashes here (vLLM's name the adapter too)
    assert len(memo) == 8  # the adapter's keys now stand under those hashes: the plain root misses them
    assert counted(digests, s, HashedReq("a2", turn)) == (scratch(turn), 8 + 1)
    image = HashedReq("c", turn, mm_features=[type("F", (), {"identifier": "img-1"})()])
    assert counted(digests, s, image)[1] == 8 + 1 and len(memo) == 8  # hashed whole, and not remembered


def test_hashes_finer_than_the_kv_blocks_keep_the_memo_out(digests: list[int]) -> None:
    """A hash of 2 tokens names less than our chunk's prefix: used, it would hand out a wrong key."""
    memo = KeyMemo()
    s = side(memo)
    turn = prompt_tokens(64, start=3)
    want = scratch(turn)
    keys_of(s, HashedReq("a", turn, block=2))
    assert counted(digests, s, HashedReq("b", turn, block=2)) == (want, 8 + 1)
    assert len(memo) == 0


def test_the_memo_is_bounded_and_drops_the_oldest_first() -> None:
    memo = KeyMemo(capacity=16)
    root = chain_root(0)
    hashes = [bytes([i]) * 32 for i in range(17)]
    keys = [bytes([100 + i]) * 16 for i in range(17)]
    memo.remember(root, hashes[:16], 1, keys[:16], 0)
    assert len(memo) == 16 and memo.known(root, hashes, 1, 99) == keys[:16]
    memo.remember(root, hashes, 1, keys, 16)  # the 17th: the oldest 16 // 8 + 1 = 3 go
    assert len(memo) == 14 and memo.known(root, hashes, 1, 99) == []
    assert memo.known(root, hashes[3:], 1, 99) == keys[3:] and memo.known(root, hashes[3:], 1, 5) == keys[3:8]
    assert memo.known(chain_root(1), hashes[3:], 1, 99) == []
    with pytest.raises(ValueError, match="at least 8 keys"):
        KeyMemo(capacity=4)
