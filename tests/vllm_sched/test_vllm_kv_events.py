"""The daemon's vLLM-format KV events read by vLLM 0.33's own classes (vllm.distributed.kv_events): the scripted
scenario of tests/kv_events_rig.py over a real ZMQ socket, decoded with msgspec into KVEventBatch, exact; the
daemon's bytes equal vLLM's encoder's for the same events; the test consumer reads both encodings vLLM has used.
And the plugin entry: vLLM's own plugin loader registers KVStoreConnector, no module path needed."""

from __future__ import annotations

import warnings
from typing import Any

import msgspec
import pytest
import zmq

from kvstore.server.kv_events.encoding import decode_batch, encode_batch
from kvstore.server.kv_events.vllm_events import AllBlocksCleared as KAll
from kvstore.server.kv_events.vllm_events import BlockRemoved as KRemoved
from kvstore.server.kv_events.vllm_events import BlockStored as KStored
from tests.kv_events_rig import Subscriber, daemon_options, scenario
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

_DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def vllm_events(payload: bytes) -> list[Any]:
    """vLLM's decoder, as its own subscribers use it."""
    return list(_DECODER.decode(payload).events)


def norm(e: Any) -> tuple:
    if isinstance(e, BlockStored):
        assert e.lora_id is None
        return ("stored", e.medium, tuple(e.block_hashes), e.parent_block_hash, tuple(e.token_ids), e.block_size,
                e.lora_name, e.ownership)
    if isinstance(e, BlockRemoved):
        return ("removed", e.medium, tuple(e.block_hashes), e.ownership)
    assert isinstance(e, AllBlocksCleared), e
    return ("cleared",)


def test_vllm_decodes_the_daemons_events_exactly(make_daemon, tmp_path) -> None:
    d = make_daemon(**daemon_options(tmp_path))
    ctx = zmq.Context()
    sub = Subscriber(ctx, d.args[d.args.index("--kv-events-endpoint") + 1], decode=vllm_events)
    try:
        got = scenario(d, sub, norm)  # put, disk writes, eviction to disk, promotion, delete, clear: exact
        assert [g[0] for g in got].count("cleared") == 1 and len(got) == 14
    finally:
        sub.close()
        ctx.term()


def test_the_daemons_bytes_are_vllms_encoding() -> None:
    ts = 1733570000.25
    ours = encode_batch(ts, [KStored((b"a" * 32, b"b" * 32), None, (1, 2, 300, 70000), 2, "CPU", "lora-x"),
                             KRemoved((b"a" * 32,), "STORAGE", "kvstore-key"), KAll()])
    theirs = msgspec.msgpack.encode(KVEventBatch(ts=ts, events=[
        BlockStored(block_hashes=[b"a" * 32, b"b" * 32], parent_block_hash=None, token_ids=[1, 2, 300, 70000],
                    block_size=2, lora_id=None, medium="CPU", lora_name="lora-x", ownership="kvstore"),
        BlockRemoved(block_hashes=[b"a" * 32], medium="STORAGE", ownership="kvstore-key"),
        AllBlocksCleared()]))
    assert ours == theirs
    # larger lists (array16/array32 headers, uint32 tokens), 20 events: still vLLM's bytes
    many = [KRemoved(tuple(bytes([i, j]) * 16 for j in range(20)), "CPU") for i in range(20)]
    tokens = tuple(range(0, 140_000, 7))
    ours = encode_batch(ts, [KStored((b"c" * 32,), b"p" * 32, tokens, 20_000, "STORAGE"), *many])
    theirs = msgspec.msgpack.encode(KVEventBatch(ts=ts, events=[
        BlockStored(block_hashes=[b"c" * 32], parent_block_hash=b"p" * 32, token_ids=list(tokens), block_size=20_000,
                    lora_id=None, medium="STORAGE", lora_name=None, ownership="kvstore"),
        *(BlockRemoved(block_hashes=list(e.block_hashes), medium="CPU", ownership="kvstore") for e in many)]))
    assert ours == theirs


class _OldStored(msgspec.Struct, array_like=True, omit_defaults=True, tag="BlockStored"):
    """The array form vLLM's events had before 0.33's tagged maps (array_like=True on KVCacheEvent)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _OldRemoved(msgspec.Struct, array_like=True, omit_defaults=True, tag="BlockRemoved"):
    block_hashes: list[bytes]
    medium: str | None


class _OldCleared(msgspec.Struct, array_like=True, omit_defaults=True, tag="AllBlocksCleared"):
    pass


class _OldBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def test_the_test_consumer_reads_both_encodings() -> None:
    old = msgspec.msgpack.encode(_OldBatch(2.0, [_OldStored([b"h"], None, [5, 6], 2, None, "GPU"),
                                                 _OldRemoved([b"h"], "GPU"), _OldCleared()], 1))
    assert decode_batch(old) == (2.0, [KStored((b"h",), None, (5, 6), 2, "GPU", None, ""),
                                       KRemoved((b"h",), "GPU", ""), KAll()])
    new = msgspec.msgpack.encode(KVEventBatch(ts=3.0, events=[
        BlockStored(block_hashes=[b"h"], parent_block_hash=b"p", token_ids=[5, 6], block_size=2, lora_id=None,
                    medium="CPU", lora_name=None), BlockRemoved(block_hashes=[b"h"], medium="CPU")]))
    assert decode_batch(new) == (3.0, [KStored((b"h",), b"p", (5, 6), 2, "CPU", None, ""),
                                       KRemoved((b"h",), "CPU", "")])


# -- the plugin entry ---------------------------------------------------------------------------------------
def test_vllms_plugin_loader_registers_the_connector() -> None:
    from importlib.metadata import entry_points

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    from kvstore_connector.plugin import register
    from kvstore_connector.vllm_connector import KVStoreConnector

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvstore"]
    assert ep.value == "kvstore_connector.plugin:register"
    load_general_plugins()  # vLLM's own loader, as every vLLM process runs it
    register()              # again: harmless
    short = KVTransferConfig(kv_connector="KVStoreConnector", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(short) is KVStoreConnector
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = KVTransferConfig(kv_connector="KVStoreConnector", kv_role="kv_both",
                               kv_connector_module_path="connector.vllm_connector")
        assert KVConnectorFactory.get_connector_class(old) is KVStoreConnector  # the one class, not a copy
    assert any(issubclass(w.category, DeprecationWarning) and "connector.vllm_connector" in str(w.message)
               for w in caught)


def test_the_old_name_is_served_where_no_package_has_it() -> None:
    """In an installed wheel there is no `connector` package: the plugin's import hook answers the two old
    names, and nothing else."""
    import importlib.util

    from kvstore_connector.legacy import LegacyPathFinder, install
    from kvstore_connector.vllm_connector import KVStoreConnector

    finder = LegacyPathFinder()
    assert finder.find_spec("connector.keys") is None and finder.find_spec("os") is None
    spec = finder.find_spec("connector.vllm_connector")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with pytest.warns(DeprecationWarning, match="drop kv_connector_module_path"):
        spec.loader.exec_module(module)
    assert module.KVStoreConnector is KVStoreConnector
    install()
    install()
    import sys
    assert sum(isinstance(f, LegacyPathFinder) for f in sys.meta_path) == 1
    assert isinstance(sys.meta_path[-1], LegacyPathFinder)  # last: a real `connector` package elsewhere wins
