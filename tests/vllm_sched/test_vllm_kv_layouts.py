"""The worker side on the KV caches vLLM 0.33 itself allocates (vllm.v1.worker.utils.allocate_kv_cache), in each
KV cache layout its GPU backends may be given: LBHNC (heads-major pages, the CPU backend's) and LBNHC (token-major
pages, vLLM 0.33's default for FlashAttention, FlashInfer and Triton, which declare no layout). LBNHC's per-layer
views are a permutation of a dense page; the connector must take them (it refused them: every model on a vLLM 0.33
GPU failed at startup), copy each page in memory order, and name the layout, so the two never exchange blocks.
"""

from __future__ import annotations

import pytest
import torch

from kvstore_connector.namespace import namespace_for
from kvstore_connector.plan import LoadJob, SaveJob
from kvstore.client import Client
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.worker.utils import allocate_kv_cache

from kvstore_connector.vllm_connector import KVStoreConnector

from .harness import BLOCK, HEAD_DIM, HEADS, LAYER_NAMES, NUM_BLOCKS
from .stored import PROMPT, chain_keys


def _worker(model_dir: str, address: str, layout: str) -> tuple[KVStoreConnector, dict[str, torch.Tensor]]:
    kv = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore_connector.vllm_connector",
                          kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"address": address, "blocks_per_key": 1})
    vc = VllmConfig(model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32"),
                    cache_config=CacheConfig(block_size=BLOCK), kv_transfer_config=kv, device_config=DeviceConfig("cpu"))
    vc.cache_config.kv_cache_layout = layout
    vc.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    kcc = get_kv_cache_config_from_groups(vc, get_kv_cache_groups(vc, dict.fromkeys(LAYER_NAMES, spec)), 1 << 40)
    kcc.kv_cache_layout = layout  # as vLLM's engine core resolves it for every worker
    caches = allocate_kv_cache(kcc, torch.device("cpu"), vc.cache_config.get_resolved_kv_cache_layout())
    w = KVStoreConnector(vc, KVConnectorRole.WORKER, kcc)
    w.register_kv_caches(caches)
    return w, caches


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_a_page_round_trips_in_vllms_own_layouts(daemon, model_dir, layout) -> None:
    w, caches = _worker(model_dir, daemon.address, layout)
    assert w._worker.spec.kv_layout == layout
    gen = torch.Generator().manual_seed(7)
    for t in {t.data_ptr(): t for t in caches.values()}.values():
        t.copy_(torch.rand(t.shape, generator=gen))
    keys = chain_keys(3, PROMPT)
    src, dst = [5, 9, 2], [40, 41, 42]
    want = {n: t[src].clone() for n, t in caches.items()}
    w._worker.save([SaveJob("s", None, keys, [src])])
    w._worker.drain()
    with Client(daemon.address) as c:
        assert sorted(k.key for k in c.keys(namespace_for(w._worker.spec))) == sorted(keys)
    w._worker.start_loads([LoadJob("l", None, keys, [dst])])
    w._worker.drain()
    assert w._worker.load_errors() == set()
    for n, t in caches.items():
        assert torch.equal(t[dst], want[n]), f"{layout}: layer {n} differs after the round trip"
    w.shutdown()


def test_the_two_layouts_never_share_a_namespace(daemon, model_dir) -> None:
    names = set()
    for layout in ("LBHNC", "LBNHC"):
        w, _ = _worker(model_dir, daemon.address, layout)
        names.add(namespace_for(w._worker.spec))
        w.shutdown()
    assert len(names) == 2
