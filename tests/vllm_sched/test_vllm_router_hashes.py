"""A router's view of the store: vLLM's real scheduler saves a prompt through KVStoreConnector into a daemon that
publishes vLLM-format KV events; a router that knows only the prompt's tokens computes vLLM's block hashes the way
vLLM does (its hash_block_tokens over sha256_cbor, chained from NONE_HASH), matches them against the events it
read, and gets exactly the prefix the store holds in each tier (RAM, disk), as the store itself reports it."""

from __future__ import annotations

import msgspec
import zmq

from kvstore.client import Client
from kvstore_connector.namespace import namespace_for
from kvstore.testing import wait_until
from tests.kv_events_rig import Subscriber, daemon_options
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils

from .harness import BLOCK, Harness

PROMPT = [(7 * i) % 900 + 20 for i in range(100)]  # 6 full blocks of 16 (the 100th token is computed, not stored)


class Router:
    """What a router keeps: per medium, the block hashes a node holds (from BlockStored / BlockRemoved)."""

    def __init__(self) -> None:
        self.held: dict[str, set[bytes]] = {}
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)

    def feed(self, payload: bytes) -> None:
        for e in self.decoder.decode(payload).events:
            if isinstance(e, BlockStored):
                self.held.setdefault(e.medium, set()).update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                self.held.get(e.medium, set()).difference_update(e.block_hashes)

    @staticmethod
    def hashes(tokens: list[int]) -> list[bytes]:
        """vLLM's block hashes of a prompt's full blocks, as vLLM computes them (no LoRA, no images, no salt)."""
        kv_cache_utils.init_none_hash(sha256_cbor)
        out: list[bytes] = []
        for i in range(len(tokens) // BLOCK):
            out.append(kv_cache_utils.hash_block_tokens(sha256_cbor, out[-1] if out else None,
                                                        tokens[i * BLOCK:(i + 1) * BLOCK], None))
        return out

    def prefix_tokens(self, tokens: list[int], medium: str) -> int:
        held, n = self.held.get(medium, set()), 0
        for h in self.hashes(tokens):
            if h not in held:
                break
            n += 1
        return n * BLOCK


def test_a_router_matches_vllms_hashes_and_gets_the_prefix_each_tier_holds(make_daemon, model_dir, tmp_path) -> None:
    d = make_daemon(**daemon_options(tmp_path, arena_bytes="64MiB", max_block_bytes="8MiB",
                                     disk_segment_bytes="8MiB", disk_bytes="64MiB"))
    ctx = zmq.Context()
    sub = Subscriber(ctx, d.args[d.args.index("--kv-events-endpoint") + 1], decode=lambda p: [p])
    router = Router()
    try:
        with Client(d.address) as c:
            sub.live(c, f"kv@{d.node_id}@warm".encode())
            h = Harness(model_dir, d.address, extra={"blocks_per_key": 1}, hash_fn=sha256_cbor)
            h.add("r1", list(PROMPT), max_tokens=1)
            h.run()
            ns = namespace_for(h.sched_side.spec)
            keys = [k.key for k in c.keys(ns)]
            assert len(keys) == 6
            wait_until(lambda: c.stats().disk.write_queue_blocks == 0, what="write-behind")
            # the last four leave RAM (the disk keeps them): RAM holds a 2-block prefix, disk all 6
            ordered = _chain(h, c, ns)
            assert c.hint(ns, ordered[2:], "demote") == ["accepted"] * 4
            topic = f"kv@{d.node_id}@{h.sched_side.spec.model}".encode()
            wait_until(lambda: (sub.take_all(50), _removed_count(sub, topic) >= 4)[1], what="the evictions' events")
            for t, _, payload in sub.frames:
                if t == topic:
                    router.feed(payload)
            (score,) = c.prefix_score(ns, ordered)
            annotated = h.worker.counters.totals.get("annotated_keys", 0)
            h.close()
        # the router's hashes are vLLM's: it matches every stored block, RAM holds 2, disk 6
        assert router.prefix_tokens(PROMPT, "CPU") == 2 * BLOCK == score.ram_tokens
        assert router.prefix_tokens(PROMPT, "STORAGE") == 6 * BLOCK == score.ram_tokens + score.disk_tokens
        assert router.held["STORAGE"] == set(Router.hashes(PROMPT)[:6])
        assert annotated == 6  # the connector sent each saved key's vLLM identity once
    finally:
        sub.close()
        ctx.term()


def _chain(h: Harness, c: Client, ns: str) -> list[bytes]:
    """The request's stored keys in chain order (the connector's keys of the prompt's full blocks)."""
    from kvstore_connector.keys import KeyChain, chain_root

    spec = h.sched_side.spec
    keys = KeyChain(spec.tokens_per_key, 0, chain_root(0)).extend(PROMPT)[:6]
    assert all(x is not None for x in c.describe(ns, keys))
    return keys


def _removed_count(sub: Subscriber, topic: bytes) -> int:
    dec = msgspec.msgpack.Decoder(type=KVEventBatch)
    return sum(len(e.block_hashes) for t, _, p in sub.frames if t == topic
               for e in dec.decode(p).events if isinstance(e, BlockRemoved))
