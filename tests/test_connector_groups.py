"""kvstore_connector/groups.py: which stored blocks a prefix hit needs from each KV cache group (vLLM's hybrid manager),
with exact values: vLLM's own documented examples of skipped tokens, the keys a windowed group saves, the hit a
set of windowed shards allows, reading vLLM's KVCacheConfig by class name (no vLLM here: small stand-ins), and
the namespace digests of group specs (a model with one full group keeps the name it had before groups)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from kvstore_connector.groups import (FULL, NULL_BLOCK, GroupKind, KVGroup, first_needed_key, groups_from_config,
                              save_points, saved_in_window, window_hit)
from kvstore_connector.namespace import KVLayoutSpec, StageLayouts, namespace_for, registration
from kvstore.errors import ConfigError

SLIDING_32, CHUNKED_64 = GroupKind("sliding", 32), GroupKind("chunked", 64)


# -- GroupKind: vLLM's get_num_skipped_tokens examples ------------------------------------------------------------
def test_skipped_tokens_follow_vllms_documented_examples() -> None:
    assert GroupKind("sliding", 4).skipped_tokens(7) == 4       # window 4 covers tokens 4..7 for the next token
    assert [GroupKind("sliding", 4).skipped_tokens(n) for n in range(6)] == [0, 0, 0, 0, 1, 2]
    chunked = GroupKind("chunked", 8)
    assert (chunked.skipped_tokens(13), chunked.skipped_tokens(8), chunked.skipped_tokens(7)) == (8, 8, 0)
    assert [FULL.skipped_tokens(n) for n in (0, 7, 10_000)] == [0, 0, 0]
    # extra_retained_tokens (speculative decoding) keep that many more trailing tokens
    assert GroupKind("sliding", 4, retained=1).skipped_tokens(7) == 3
    assert GroupKind("sliding", 4, retained=10).skipped_tokens(7) == 0


def test_first_needed_block_is_the_first_block_vllm_keeps() -> None:
    # sliding 32, blocks of 16: after 96 tokens the next one attends to 65..96, so blocks 0..3 are null
    assert [SLIDING_32.first_needed_block(n, 16) for n in (0, 31, 32, 47, 48, 96, 97)] == [0, 0, 0, 1, 1, 4, 4]
    assert [CHUNKED_64.first_needed_block(n, 16) for n in (0, 63, 64, 127, 128)] == [0, 0, 4, 4, 8]
    assert FULL.first_needed_block(1000, 16) == 0


def test_kinds_validate_and_describe_themselves() -> None:
    with pytest.raises(ValueError, match="unknown KV cache group kind 'mamba'"):
        GroupKind("mamba")
    with pytest.raises(ValueError, match="a sliding group needs a window >= 1, got 0"):
        GroupKind("sliding")
    assert [k.describe() for k in (FULL, SLIDING_32, CHUNKED_64, GroupKind("sliding", 4, 2))] == [
        "full", "sliding=32", "chunked=64", "sliding=4+2"]
    assert (FULL.windowed, SLIDING_32.windowed, CHUNKED_64.windowed) == (False, True, True)
    assert NULL_BLOCK == 0


# -- saving: save points and the keys a windowed group keeps ------------------------------------------------------
def test_save_points() -> None:
    assert save_points(100, 16, 0) == [96]              # the next turn and the same prompt both hit 96 tokens
    assert save_points(96, 16, 0) == [80, 96]           # the same prompt again: vLLM computes token 95 itself
    assert save_points(100, 16, 32) == [32, 64, 96]
    assert save_points(100, 16, 40) == [32, 80, 96]     # checkpoints rounded down to a stored block
    assert save_points(100, 16, 8) == [16, 32, 48, 64, 80, 96]
    assert save_points(15, 16, 0) == save_points(1, 16, 0) == save_points(0, 16, 4) == []


def saved_keys(kind: GroupKind, points: list[int], *, keys: int = 7, t: int = 16, bs: int = 16) -> list[int]:
    return [k for k in range(keys) if saved_in_window(kind, k, tokens_per_key=t, block_size=bs, save_points=points)]


def test_saved_in_window_keeps_only_the_window_before_each_save_point() -> None:
    assert saved_keys(SLIDING_32, [96]) == [4, 5]       # the next token after 96 needs blocks 4 and 5
    assert saved_keys(SLIDING_32, [48, 96]) == [1, 2, 4, 5]
    assert saved_keys(SLIDING_32, [32, 64, 96]) == [0, 1, 2, 3, 4, 5]
    assert saved_keys(CHUNKED_64, [96]) == [4, 5]       # the chunk 64..127 so far
    assert saved_keys(CHUNKED_64, [64]) == []           # a new chunk starts at 64: nothing before it is needed
    assert saved_keys(CHUNKED_64, [48]) == [0, 1, 2]
    assert saved_keys(FULL, [96]) == [0, 1, 2, 3, 4, 5]  # no window: every key before the point
    # two blocks of 8 per key: sliding 20 after 48 tokens needs blocks 3.. (tokens 29..), i.e. keys 1 and 2
    assert saved_keys(GroupKind("sliding", 20), [48], t=16, bs=8) == [1, 2]


def test_first_needed_key() -> None:
    assert [first_needed_key(SLIDING_32, n, tokens_per_key=16, block_size=16) for n in range(7)] == [
        0, 0, 0, 1, 2, 3, 4]
    assert [first_needed_key(CHUNKED_64, n, tokens_per_key=16, block_size=16) for n in range(9)] == [
        0, 0, 0, 0, 4, 4, 4, 4, 8]
    assert first_needed_key(GroupKind("sliding", 20), 3, tokens_per_key=16, block_size=8) == 1  # block 3 -> key 1
    assert first_needed_key(FULL, 50, tokens_per_key=16, block_size=16) == 0


# -- lookups: the hit windowed shards allow ------------------------------------------------------------------------
def hit(limit: int, *shards: tuple[GroupKind, list[bool]]) -> int:
    return window_hit(limit, list(shards), tokens_per_key=16, block_size=16)


def present(n: int, *missing: int) -> list[bool]:
    return [i not in missing for i in range(n)]


def test_window_hit_exact_values() -> None:
    assert hit(6, (SLIDING_32, present(6))) == 6
    assert hit(6, (SLIDING_32, present(6, 0, 1, 2, 3))) == 6    # holes before the window cost nothing
    assert hit(6, (SLIDING_32, present(6, 1))) == 6
    assert hit(6, (SLIDING_32, present(6, 5))) == 5             # a hit of 5 needs keys 3 and 4 only
    assert hit(6, (SLIDING_32, present(6, 4))) == 4             # 6 and 5 both need key 4; 4 needs keys 2 and 3
    assert hit(6, (SLIDING_32, present(6, 2, 4))) == 2          # 4 needs key 2 too; 3 needs 1, 2; 2 needs 0, 1
    assert hit(6, (SLIDING_32, present(6, 0))) == 6
    assert hit(2, (SLIDING_32, present(6, 0))) == 0             # every hit of <= 2 keys needs key 0
    assert hit(4, (SLIDING_32, present(8, 6, 7))) == 4          # keys past the limit are not looked at
    assert hit(0, (SLIDING_32, present(6))) == 0
    assert hit(0) == 0 and hit(5) == 5                          # no windowed shard: the full groups' limit


def test_window_hit_of_two_windowed_shards_with_different_kinds() -> None:
    # 6: chunked needs keys 4, 5 (lacks 5); 5: sliding needs 3, 4 (lacks 3); 4: sliding needs 2, 3;
    # 3: sliding needs 1, 2 and chunked 0..2 -> 3
    assert hit(6, (SLIDING_32, present(6, 3)), (CHUNKED_64, present(6, 5))) == 3
    assert hit(6, (SLIDING_32, present(6, 3)), (CHUNKED_64, present(6))) == 6   # key 3 is before 6's window
    assert hit(6, (SLIDING_32, present(6)), (CHUNKED_64, present(6, 5))) == 5   # 5 needs key 4 of the chunk
    assert hit(6, (SLIDING_32, present(6)), (CHUNKED_64, present(6, 4))) == 4   # at 4 a chunk starts: no keys
    # a chunked shard holding nothing still serves a hit ending exactly on a chunk boundary
    assert hit(5, (CHUNKED_64, present(6, *range(6)))) == 4
    assert hit(3, (CHUNKED_64, present(6, *range(6)))) == 0


# -- reading vLLM's KVCacheConfig (stand-ins with vLLM's class names) ---------------------------------------------
@dataclass
class FullAttentionSpec:
    block_size: int = 16
    page_size_bytes: int = 4096


class MLAAttentionSpec(FullAttentionSpec):  # vLLM's MLAAttentionSpec derives from FullAttentionSpec too
    pass


@dataclass
class SlidingWindowSpec:
    sliding_window: int = 32
    block_size: int = 16
    page_size_bytes: int = 4096
    extra_retained_tokens: int = 0


@dataclass
class ChunkedLocalAttentionSpec:
    attention_chunk_size: int = 64
    block_size: int = 16
    page_size_bytes: int = 4096


@dataclass
class MambaSpec:
    block_size: int = 16
    page_size_bytes: int = 4096


@dataclass
class UniformTypeKVCacheSpecs:
    kv_cache_specs: dict[str, object]
    block_size: int = 16

    @property
    def page_size_bytes(self) -> int:
        return sum(s.page_size_bytes for s in self.kv_cache_specs.values())


@dataclass
class Group:
    layer_names: list[str]
    kv_cache_spec: object


@dataclass
class Config:
    kv_cache_groups: list[Group] = field(default_factory=list)


def test_groups_from_a_hybrid_config() -> None:
    cfg = Config([Group(["l0", "l3"], FullAttentionSpec(page_size_bytes=1000)),
                  Group(["l1", "l4"], SlidingWindowSpec(sliding_window=512, page_size_bytes=1000,
                                                        extra_retained_tokens=3)),
                  Group(["l2"], ChunkedLocalAttentionSpec(attention_chunk_size=8192, page_size_bytes=700))])
    assert groups_from_config(cfg) == [
        KVGroup(0, FULL, ("l0", "l3"), 16, 2000),                                # page size per layer x layers
        KVGroup(1, GroupKind("sliding", 512, 3), ("l1", "l4"), 16, 2000),
        KVGroup(2, GroupKind("chunked", 8192), ("l2",), 16, 700)]
    assert [g.num_layers for g in groups_from_config(cfg)] == [2, 2, 1]


def test_mla_is_full_attention_and_uniform_type_specs_give_their_total_page() -> None:
    assert groups_from_config(Config([Group(["a", "b", "c"], MLAAttentionSpec(page_size_bytes=576 * 16 * 2))])) == [
        KVGroup(0, FULL, ("a", "b", "c"), 16, 3 * 576 * 16 * 2)]
    uniform = UniformTypeKVCacheSpecs({"a": SlidingWindowSpec(sliding_window=8, page_size_bytes=100),
                                       "b": SlidingWindowSpec(sliding_window=8, page_size_bytes=300)})
    assert groups_from_config(Config([Group(["a", "b"], uniform)])) == [
        KVGroup(0, GroupKind("sliding", 8), ("a", "b"), 16, 400)]                 # already the sum of its layers


def test_no_config_is_one_full_group_over_the_registered_layers() -> None:
    assert groups_from_config(None, ["x", "y"]) == [KVGroup(0, FULL, ("x", "y"), 0, 0)]
    assert groups_from_config(Config([]), ()) == [KVGroup(0, FULL, (), 0, 0)]


def test_configs_the_connector_cannot_store_fail_with_a_clear_error() -> None:
    with pytest.raises(ConfigError) as e:
        groups_from_config(Config([Group(["a"], FullAttentionSpec()), Group(["m"], MambaSpec())]))
    assert "cannot store a KV cache group of type MambaSpec" in str(e.value)
    assert "serve this model without --kv-transfer-config" in str(e.value)
    with pytest.raises(ConfigError, match=r"one block size across KV cache groups, got \[16, 32\]"):
        groups_from_config(Config([Group(["a"], FullAttentionSpec(block_size=16)),
                                   Group(["b"], SlidingWindowSpec(block_size=32))]))


# -- namespace digests ---------------------------------------------------------------------------------------------
BASE = KVLayoutSpec(model="org/tiny", dtype="float16", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8,
                    tp_rank=0, tp_size=1, blocks_per_key=2)
# BASE.digest() computed by the code before groups (`git show 36d123e:kvstore_connector/namespace.py`): stored blocks of a
# model with one full-attention group must stay reachable under the same name
BEFORE_GROUPS = "f53608b7e3b2012c"
BEFORE_GROUPS_STAGE = "38b14a6a1b7e3c02"  # replace(BASE, first_layer=2, tp_rank=1, tp_size=2), same code


def test_a_spec_without_groups_keeps_its_name_from_before_groups() -> None:
    assert BASE.digest() == BEFORE_GROUPS and namespace_for(BASE) == f"vllm/tiny/{BEFORE_GROUPS}"
    assert replace(BASE, first_layer=2, tp_rank=1, tp_size=2).digest() == BEFORE_GROUPS_STAGE
    assert replace(BASE, group_index=0, group_count=1, group_layers=0).digest() == BEFORE_GROUPS  # kind None
    assert BASE.group_kind == FULL and BASE.bytes_per_token == 2 * 3 * 2 * 8 * 2


def test_group_specs_name_their_group() -> None:
    g0 = replace(BASE, kind=FULL, group_index=0, group_count=2, group_layers=2)
    g1 = replace(BASE, kind=GroupKind("sliding", 8), group_index=1, group_count=2, group_layers=1)
    digests = {BASE.digest(), g0.digest(), g1.digest(), replace(g1, kind=GroupKind("sliding", 16)).digest(),
               replace(g1, kind=GroupKind("chunked", 8)).digest()}
    assert len(digests) == 5
    # a group's layer count and page bytes on another pipeline stage are not known to every process: the stage's
    # layer range and the group's index name its layers (vllm_connector.stage_specs)
    assert replace(g0, group_layers=3, page_bytes=12345).digest() == g0.digest()
    stages = StageLayouts([g0, g1])
    n0, n1 = stages.names()
    assert (n0, n1) == (f"vllm/tiny/{g0.digest()}", f"vllm/tiny/{g1.digest()}")
    assert stages.registration(n1) == registration(g1) == {"model": "org/tiny", "layout_digest": g1.digest(),
                                                           "tokens_per_block": 8}


def test_page_bytes_size_a_block_and_enter_the_digest_only_when_set() -> None:
    mla = replace(BASE, page_bytes=4 * 576 * 2)          # one latent per token and layer, not K and V
    assert (mla.bytes_per_token, mla.block_bytes) == (576 * 2, 4 * 576 * 2)
    assert mla.digest() != BEFORE_GROUPS
    assert replace(BASE, page_bytes=0).digest() == BEFORE_GROUPS
