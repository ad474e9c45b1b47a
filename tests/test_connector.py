"""The connector's vLLM-independent parts: configuration, keys, namespaces and layout plans (the scheduler side
and worker side against a real daemon: test_connector_sides.py; shared parts: tests/connector_helpers.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from kvstore_connector.config import ConnectorConfig
from kvstore_connector.keys import KeyChain, chain_root
from kvstore_connector.layout import KVLayout, LayoutError
from kvstore_connector.namespace import KVLayoutSpec, StageLayouts, namespace_for, registration
from kvstore._native import copy_addrs
from kvstore.errors import ConfigError
from tests.connector_helpers import BS, HD, HEADS, LAYERS, NBLOCKS, SPEC, block_bytes_of, make_caches

pytestmark = pytest.mark.usefixtures("control_path")  # every test over the fast path and over gRPC


# -- config ------------------------------------------------------------------------------------------------
def test_config_defaults_and_auto_blocks_per_key() -> None:
    c = ConnectorConfig.from_extra(None)
    assert (c.save, c.load, c.blocks_per_key, c.address) == ("prompt", True, None, None)
    assert c.resolve_blocks_per_key(2 << 20) == 1            # a 2 MiB block is already >= 0.5 MiB
    assert c.resolve_blocks_per_key(64 << 10) == 8           # 8 x 64 KiB = 512 KiB
    assert c.resolve_blocks_per_key(1024) == 16              # capped by max_blocks_per_key
    assert ConnectorConfig.from_extra({"blocks_per_key": 3}).resolve_blocks_per_key(1024) == 3
    assert ConnectorConfig.from_extra({"load": "false", "save": "all"}).load is False


@pytest.mark.parametrize("extra, fragment", [
    ({"adress": "/tmp/x"}, "unknown kv_connector_extra_config key(s) ['adress']"),
    ({"save": "everything"}, "save='everything': use one of ('prompt', 'all', 'off')"),
    ({"load_timeout_s": 0}, "load_timeout_s=0 is out of range"),
    ({"lookup_timeout_s": "soon"}, "lookup_timeout_s='soon': expected a number"),
    ({"blocks_per_key": 1.5}, "blocks_per_key=1.5: expected a whole number"),
    ({"copy_threads": 0}, "copy_threads=0 is out of range"),
    ({"load": "maybe"}, "load='maybe': use true or false"),
    ({"address": 7070}, "address=7070: use a socket path or host:port string"),
])
def test_config_rejects_bad_values_with_a_fix(extra: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as e:
        ConnectorConfig.from_extra(extra)
    assert fragment in str(e.value)


# -- keys and namespaces ---------------------------------------------------------------------------------
def test_keys_are_chained_stable_and_incremental() -> None:
    root = chain_root(0)
    a = KeyChain(8, 0, root)
    a.extend(list(range(20)))
    assert len(a.keys) == 2                                   # 20 tokens = 2 full chunks of 8
    a.extend(list(range(33)))
    b = KeyChain(8, 0, root).extend(list(range(33)))
    assert a.keys == b == KeyChain(8, 0, chain_root(0)).extend(list(range(32)))
    assert len(b) == 4 and len(set(b)) == 4 and all(len(k) == 16 for k in b)
    diverged = KeyChain(8, 0, root).extend(list(range(16)) + [999] + list(range(17, 32)))
    assert diverged[:2] == b[:2] and diverged[2] != b[2] and diverged[3] != b[3]   # a prefix, not a chunk
    assert KeyChain(8, 1, chain_root(1)).extend(list(range(8)))[0] != b[0]        # seed
    assert KeyChain(8, 0, chain_root(0, lora_name="x")).extend(list(range(8)))[0] != b[0]
    assert KeyChain(8, 0, chain_root(0, mm_hashes=["img"])).extend(list(range(8)))[0] != b[0]


def test_namespaces_separate_layouts_models_and_salts() -> None:
    base = namespace_for(SPEC)
    assert base.startswith("vllm/tiny/") and base == namespace_for(SPEC)
    other = {namespace_for(KVLayoutSpec(**{**SPEC.__dict__, f: v}))
             for f, v in (("tp_rank", 1), ("tp_size", 2), ("dtype", "bfloat16"), ("block_size", 16),
                          ("model", "other/tiny"), ("num_layers", 4), ("blocks_per_key", 1), ("first_layer", 3))}
    assert len(other) == 8 and base not in other
    assert namespace_for(SPEC, "s1") != namespace_for(SPEC, "s2") != base
    assert registration(SPEC) == {"model": "org/tiny", "layout_digest": SPEC.digest(), "tokens_per_block": 8}
    assert SPEC.block_bytes == 2 * LAYERS * HEADS * HD * 2 * BS
    # a layout without pipeline stages keeps the digest it had before stages were named
    assert SPEC.digest() == "f53608b7e3b2012c"                # what the digest was before first_layer


def test_pipeline_stages_have_their_own_namespaces() -> None:
    """Two stages with the same layer count (an even split) differ only by their layer range: before, they had
    one namespace, and stage 1 could load stage 0's layers."""
    even = [replace(SPEC, num_layers=2, first_layer=0), replace(SPEC, num_layers=2, first_layer=2)]
    stages = StageLayouts(even)
    n0, n1 = stages.names()
    assert n0 != n1 and stages.names("salt") == [namespace_for(even[0], "salt"), namespace_for(even[1], "salt")]
    assert [stages.registration(n)["layout_digest"] for n in (n0, n1)] == [even[0].digest(), even[1].digest()]
    assert stages.registration(stages.names("salt")[1]) == registration(even[1])
    with pytest.raises(KeyError, match="belongs to none of this model's 2 stage layouts"):
        stages.registration(namespace_for(SPEC))
    with pytest.raises(ValueError, match=r"disagree on tokens per stored block: \[4, 8\]"):
        StageLayouts([SPEC, replace(SPEC, blocks_per_key=1, first_layer=3)])


def test_plan_gathers_and_scatters_exact_bytes() -> None:
    caches = make_caches(1)
    lay = KVLayout(caches, NBLOCKS)
    assert (lay.num_pieces, lay.block_bytes) == (2 * LAYERS, SPEC.block_bytes)
    arena = np.zeros(4 * lay.block_bytes, dtype=np.uint8)
    slots = [arena.ctypes.data, arena.ctypes.data + 2 * lay.block_bytes]
    plan = lay.plan(slots, [[5, 9], [2, 3]], to_store=True)
    assert plan.nbytes == 4 * lay.block_bytes and len(plan.lengths) == 4 * lay.num_pieces
    copy_addrs(plan.dst, plan.src, plan.lengths)
    assert arena.tobytes() == b"".join(block_bytes_of(caches, b) for b in (5, 9, 2, 3))
    # scatter into another cache, leaving block 40's target untouched (-1)
    dst = make_caches(2)
    keep = dst["model.layers.0.attn"][0, 40].clone()
    plan = KVLayout(dst, NBLOCKS).plan(slots, [[30, 31], [-1, 41]], to_store=False)
    copy_addrs(plan.dst, plan.src, plan.lengths)
    assert [block_bytes_of(dst, b) for b in (30, 31, 41)] == [block_bytes_of(caches, b) for b in (5, 9, 3)]
    assert torch.equal(dst["model.layers.0.attn"][0, 40], keep)


def test_cross_layer_layout_is_one_copy_per_run() -> None:
    t = torch.arange(NBLOCKS * LAYERS * 2 * 16, dtype=torch.float32).reshape(NBLOCKS, LAYERS, 2, 16)
    lay = KVLayout({"all": t}, NBLOCKS)
    arena = np.zeros(4 * lay.block_bytes, dtype=np.uint8)
    plan = lay.plan([arena.ctypes.data, arena.ctypes.data + 2 * lay.block_bytes], [[6, 7], [1, 3]], to_store=True)
    assert len(plan.lengths) == 3          # 6,7 are adjacent -> one run; 1 and 3 are not
    copy_addrs(plan.dst, plan.src, plan.lengths)
    assert arena.tobytes() == t[[6, 7, 1, 3]].numpy().tobytes()


def test_a_permuted_dense_page_is_one_piece_in_memory_order() -> None:
    """vLLM 0.33's default GPU layout (LBNHC): per-layer views (blocks, K/V, tokens, heads x dim) of pages stored
    token-major, so K/V has the smaller stride. The page is still one dense range: one piece per block, copied in
    memory order, and a load puts back exactly the same view."""
    phys = torch.arange(NBLOCKS * 16 * 2 * 8, dtype=torch.float32).reshape(NBLOCKS, 16, 2, 8)
    view = phys.permute(0, 2, 1, 3)                                   # (blocks, K/V, tokens, channels)
    assert view.stride() == (256, 8, 16, 1)
    lay = KVLayout({"l": view}, NBLOCKS)
    assert (lay.num_pieces, lay.block_bytes) == (1, 16 * 2 * 8 * 4)
    arena = np.zeros(2 * lay.block_bytes, dtype=np.uint8)
    plan = lay.plan([arena.ctypes.data, arena.ctypes.data + lay.block_bytes], [[5], [9]], to_store=True)
    copy_addrs(plan.dst, plan.src, plan.lengths)
    assert arena.tobytes() == phys[[5, 9]].numpy().tobytes()
    other = torch.zeros_like(phys)
    plan = KVLayout({"l": other.permute(0, 2, 1, 3)}, NBLOCKS).plan([arena.ctypes.data], [[40]], to_store=False)
    copy_addrs(plan.dst, plan.src, plan.lengths)
    assert torch.equal(other.permute(0, 2, 1, 3)[40], view[5]) and int((other != 0).sum()) == int((phys[5] != 0).sum())


def test_layout_errors_say_what_is_wrong() -> None:
    with pytest.raises(LayoutError, match="no dimension of size num_blocks=64"):
        KVLayout({"l": torch.zeros(2, 10, 4)}, NBLOCKS)
    with pytest.raises(LayoutError, match="not contiguous"):
        KVLayout({"l": torch.zeros(2, NBLOCKS, 8, 8)[:, :, :, :4]}, NBLOCKS)      # gaps inside a block
    lay = KVLayout(make_caches(0), NBLOCKS)
    with pytest.raises(LayoutError, match="out of range"):
        lay.plan([0], [[NBLOCKS, 0]], to_store=True)


def test_keys_are_the_documented_chain_exactly() -> None:
    """key_i = xxh3_128(key_{i-1} + int64 LE tokens of chunk i, seed): stored keys outlive versions (disk tier,
    peers), so any other byte layout would orphan every block stored before. Lists, numpy arrays and growth in
    steps give the same keys."""
    import xxhash

    tokens = [(i * 7919) % 200_003 for i in range(8 * 5 + 3)]
    root = chain_root(3)
    want, prev = [], root
    for c in range(5):
        prev = xxhash.xxh3_128_digest(prev + b"".join(x.to_bytes(8, "little") for x in tokens[8 * c: 8 * c + 8]),
                                      seed=3)
        want.append(prev)
    assert KeyChain(8, 3, root).extend(tokens) == want
    assert KeyChain(8, 3, root).extend(np.asarray(tokens, dtype=np.int32)) == want
    grown = KeyChain(8, 3, root)
    grown.extend(tokens[:13])
    assert grown.extend(tokens) == want
