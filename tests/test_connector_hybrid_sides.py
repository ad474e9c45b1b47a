"""The connector's scheduler side + worker side with two KV cache groups (vLLM's hybrid manager: a full-attention
group and a sliding-window group, window 12 tokens) against a real daemon, driven like vLLM drives them: each
group's namespace holds exactly the keys a later hit can use and exactly its own layers' bytes (also when the
two groups' layers share one tensor, as vLLM allocates them), a load fills exactly the blocks vLLM keeps, and a
lookup answers the exact hit every group can serve. kvstore_connector/groups.py's rules alone: test_connector_groups.py.

Blocks of 4 tokens, 2 per stored block (8 tokens per key). A 50-token prompt has 6 full keys (48 tokens): the
full group stores all 6; after 48 tokens the next token attends to tokens 37..48, i.e. vLLM keeps blocks 9..12 of
the sliding group, so that group stores keys 4 and 5 only (blocks 8..11).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from kvstore_connector.config import ConnectorConfig
from kvstore_connector.groups import FULL, GroupKind
from kvstore_connector.keys import KeyChain, chain_root
from kvstore_connector.link import StoreLink
from kvstore_connector.namespace import KVLayoutSpec, StageLayouts, namespace_for
from kvstore_connector.scheduler import ScheduledRequest, SchedulerSide
from kvstore_connector.worker import WorkerSide
from kvstore.client import Client
from kvstore.testing import DaemonProcess
from tests.connector_helpers import Req, prompt_tokens

BS, HEADS, HD, NB, WINDOW = 4, 2, 8, 64, 12
T = 2 * BS                                                    # tokens per stored block (blocks_per_key=2)
NAMES = [f"model.layers.{i}.attn" for i in range(4)]
GROUP_LAYERS = [[NAMES[0], NAMES[2]], [NAMES[1], NAMES[3]]]  # full, sliding: interleaved like Gemma's layers
PAGE = 2 * HEADS * HD * 2 * BS                                # one layer's K and V of one vLLM block, float16
BASE = KVLayoutSpec(model="org/hybrid", dtype="float16", block_size=BS, num_layers=4, num_kv_heads=HEADS,
                    head_dim=HD, tp_rank=0, tp_size=1, blocks_per_key=2)
SPECS = [replace(BASE, kind=FULL, group_index=0, group_count=2, group_layers=2, page_bytes=2 * PAGE),
         replace(BASE, kind=GroupKind("sliding", WINDOW), group_index=1, group_count=2, group_layers=2,
                 page_bytes=2 * PAGE)]
PROMPT_LEN = 50
SRC_TABLES = [list(range(1, 14)), list(range(20, 33))]       # 13 blocks per group: 50 tokens


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess(arena_bytes="64MiB", max_block_bytes="4MiB") as d:
        yield d


def make_caches(seed: int | None, shared: bool) -> dict[str, torch.Tensor]:
    """Per-layer KV caches (2, blocks, block_size, heads, head_dim); ``shared``: as vLLM allocates a hybrid model's,
    one tensor per pair of layers from different groups (the groups' tables index disjoint blocks of it).
    ``seed`` None: every element -5.0 (a sentinel)."""
    def one() -> torch.Tensor:
        if seed is None:
            return torch.full((2, NB, BS, HEADS, HD), -5.0, dtype=torch.float16)
        return torch.randn(2, NB, BS, HEADS, HD, generator=gen).to(torch.float16)

    gen = torch.Generator().manual_seed(seed or 0)
    if not shared:
        return {n: one() for n in NAMES}
    a, b = one(), one()
    return {NAMES[0]: a, NAMES[1]: a, NAMES[2]: b, NAMES[3]: b}


def key_bytes(caches: dict[str, torch.Tensor], group: int, blocks: list[int]) -> bytes:
    """One stored block of ``group``: its vLLM blocks in order, each layer of the group (only), K then V."""
    return b"".join(caches[n][kv, b].numpy().tobytes() for b in blocks for n in GROUP_LAYERS[group] for kv in (0, 1))


class HybridSide:
    """One scheduler side and one worker side with the two groups, sharing a daemon."""

    def __init__(self, address: str, caches: dict[str, torch.Tensor], **extra: object) -> None:
        self.config = ConnectorConfig.from_extra({"address": address, "blocks_per_key": 2, "load_mode": "async",
                                                  **extra})
        stages = StageLayouts(SPECS)
        mk = lambda: StoreLink(address, timeout_s=5.0, namespace_spec=stages.registration)  # noqa: E731
        self.sched = SchedulerSide(self.config, SPECS[0], mk(), stages=stages)
        self.worker = WorkerSide(self.config, SPECS[0], mk(), group_specs=SPECS, group_layers=GROUP_LAYERS)
        self.worker.register(caches, NB)
        self.caches = caches

    def prefill(self, req: Req, tables: list[list[int]]) -> list:
        """Schedule the whole prompt in one step (after any load), run the worker's save; the step's save jobs."""
        self.sched.track(req)
        plan = self.sched.build([ScheduledRequest(req.request_id, [list(t) for t in tables], True,
                                                  len(req.prompt_token_ids) - req.num_computed_tokens)])
        self.worker.start_loads(plan.loads)
        self.worker.save(plan.saves)
        self.worker.drain()
        req.num_computed_tokens = len(req.prompt_token_ids)
        return plan.saves

    def close(self) -> None:
        self.worker.close()


def stored(address: str, salt: str) -> list[dict[bytes, bytes]]:
    """Every group namespace's keys and bytes for ``salt``."""
    with Client(address) as c:
        out = []
        for spec in SPECS:
            ns = namespace_for(spec, salt)
            keys = [k.key for k in c.keys(ns)]
            out.append(dict(zip(keys, c.get_many(ns, keys))))
        return out


def chain(prompt: list[int]) -> list[bytes]:
    return KeyChain(T, 0, chain_root(0)).extend(prompt)


def expected_store(caches: dict[str, torch.Tensor], keys: list[bytes], saved: list[list[int]]) -> list[dict]:
    """What each group's namespace holds when group g saved keys ``saved[g]`` from SRC_TABLES."""
    return [{keys[k]: key_bytes(caches, g, SRC_TABLES[g][2 * k:2 * k + 2]) for k in saved[g]} for g in range(2)]


def holds_exactly(dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor], copied: list) -> bool:
    """Whether every tensor of ``dst`` is unchanged (the sentinel) except the blocks a load filled: for group g,
    ``copied[g]`` pairs (dst block, src block) of that group's layers only."""
    want = {id(t): t.clone().fill_(-5.0) for t in dst.values()}
    for g, pairs in enumerate(copied):
        for d, s in pairs:
            for n in GROUP_LAYERS[g]:
                want[id(dst[n])][:, d] = src[n][:, s]
    return all(torch.equal(t, want[id(t)]) for t in dst.values())


@pytest.mark.parametrize("shared", [False, True], ids=["own-tensors", "shared-tensors"])
def test_save_trims_the_sliding_group_to_its_window_and_stores_each_groups_own_layers(daemon, shared) -> None:
    a = HybridSide(daemon.address, make_caches(1, shared))
    prompt, salt = prompt_tokens(PROMPT_LEN, start=11), f"trim-{shared}"
    (job,) = a.prefill(Req("r1", prompt, cache_salt=salt), SRC_TABLES)
    assert job.block_ids == [SRC_TABLES[0][:12], [-1] * 8 + SRC_TABLES[1][8:12]]
    keys = chain(prompt)
    assert len(keys) == 6
    got = stored(daemon.address, salt)
    assert got == expected_store(a.caches, keys, [[0, 1, 2, 3, 4, 5], [4, 5]])
    assert {len(v) for g in got for v in g.values()} == {2 * 2 * PAGE}   # 2 blocks x the group's 2 layers, not 4
    totals = a.worker.counters.totals
    assert (totals["saved_blocks"], totals["saved_bytes"]) == (8, 8 * 2 * 2 * PAGE)
    a.close()


@pytest.mark.parametrize(("extra", "sliding_keys"), [({"window_save": "all"}, [0, 1, 2, 3, 4, 5]),
                                                     ({"window_checkpoint_tokens": 24}, [1, 2, 4, 5]),
                                                     ({"window_checkpoint_tokens": 40}, [3, 4, 5])])
def test_window_save_all_and_checkpoints(daemon, extra, sliding_keys) -> None:
    """"all": every key. Checkpoints every 24 tokens: also the window before token 24 (tokens 13..23, blocks
    3..5: keys 1 and 2); every 40: before token 40 (tokens 29..39, blocks 7..9: keys 3 and 4)."""
    a = HybridSide(daemon.address, make_caches(2, False), **extra)
    prompt, salt = prompt_tokens(PROMPT_LEN, start=12), f"ws-{sorted(extra.items())}"
    a.prefill(Req("r1", prompt, cache_salt=salt), SRC_TABLES)
    assert stored(daemon.address, salt) == expected_store(a.caches, chain(prompt), [list(range(6)), sliding_keys])
    a.close()


def test_a_sliding_key_with_a_null_block_is_not_saved_in_that_group(daemon) -> None:
    """vLLM's null block (id 0) in the sliding group's table (a block it handed back) holds no KV of this request:
    the key that holds it is saved by the full group only."""
    a = HybridSide(daemon.address, make_caches(3, True))
    prompt, salt = prompt_tokens(PROMPT_LEN, start=13), "null"
    tables = [SRC_TABLES[0], SRC_TABLES[1][:9] + [0] + SRC_TABLES[1][10:]]   # key 4's second block is null
    (job,) = a.prefill(Req("r1", prompt, cache_salt=salt), tables)
    assert job.block_ids == [SRC_TABLES[0][:12], [-1] * 10 + SRC_TABLES[1][10:12]]
    assert stored(daemon.address, salt) == expected_store(a.caches, chain(prompt), [list(range(6)), [5]])
    assert a.worker.counters.totals["saved_blocks"] == 7
    a.close()


@pytest.mark.parametrize("shared", [False, True], ids=["own-tensors", "shared-tensors"])
def test_a_load_fills_exactly_the_blocks_vllm_keeps_in_each_group(daemon, shared) -> None:
    a = HybridSide(daemon.address, make_caches(4, shared))
    prompt, salt = prompt_tokens(PROMPT_LEN, start=14), f"load-{shared}"
    a.prefill(Req("r1", prompt, cache_salt=salt), SRC_TABLES)
    b = HybridSide(daemon.address, make_caches(None, shared))            # an empty vLLM: every block a sentinel
    req = Req("r2", list(prompt), cache_salt=salt)
    assert b.sched.num_new_matched_tokens(req, 0) == (48, True)
    # vLLM's tables after 48 external tokens: the sliding group's blocks 0..8 are its null block (id 0)
    dst = [list(range(40, 53)), [0] * 9 + [54, 55, 56, 57]]
    b.sched.after_alloc(req, dst, 48)
    (job,) = b.sched.build([]).loads
    assert job.block_ids == [dst[0][:12], [-1] * 9 + [54, 55, 56]]
    b.worker.start_loads([job])
    b.worker.drain()
    assert b.worker.finished(set()) == (set(), {"r2"}) and b.worker.load_errors() == set()
    assert b.worker.counters.totals["loaded_blocks"] == 6 + 2   # keys 4 and 5 of the sliding group
    assert holds_exactly(b.caches, a.caches, [zip(dst[0][:12], SRC_TABLES[0][:12]),
                                              zip([54, 55, 56], SRC_TABLES[1][9:12])])
    assert {n: int((t != -5.0).any(dim=(0, 2, 3, 4)).sum()) for n, t in b.caches.items()} == (
        {n: 15 for n in NAMES} if shared else {NAMES[0]: 12, NAMES[1]: 3, NAMES[2]: 12, NAMES[3]: 3})
    a.close(), b.close()


def lookup(side: HybridSide, prompt: list[int], salt: str, rid: str) -> int:
    tokens, is_async = side.sched.num_new_matched_tokens(Req(rid, list(prompt), cache_salt=salt), 0)
    assert is_async or tokens == 0
    return tokens


def test_a_hole_in_the_sliding_window_answers_the_exact_shorter_hit(daemon) -> None:
    a = HybridSide(daemon.address, make_caches(5, False), window_save="all")
    prompt, salt = prompt_tokens(PROMPT_LEN, start=15), "hole"
    a.prefill(Req("r1", prompt, cache_salt=salt), SRC_TABLES)
    keys, (ns0, ns1) = chain(prompt), [namespace_for(s, salt) for s in SPECS]
    b = HybridSide(daemon.address, make_caches(6, False))
    assert lookup(b, prompt, salt, "q1") == 48
    with Client(daemon.address) as c:
        assert c.delete(ns1, keys[0:1]) == 1          # before every window a hit of 4+ keys needs: no change
        assert lookup(b, prompt, salt, "q2") == 48
        assert c.delete(ns1, keys[4:5]) == 1          # 6 and 5 keys need key 4; 4 keys need keys 2, 3
        assert lookup(b, prompt, salt, "q3") == 32
        assert b.sched.counters.totals.get("lookup_window_short_keys", 0) == 2
        assert c.delete(ns0, keys[2:3]) == 1          # the full group holds 2 keys; 2 need sliding keys 0, 1
        assert lookup(b, prompt, salt, "q4") == 0     # ... and key 0 is gone
        c.put(ns1, keys[0], bytes(2 * 2 * PAGE))
        assert lookup(b, prompt, salt, "q5") == 16
    assert b.sched.counters.totals["hit_tokens"] == 48 + 48 + 32 + 0 + 16
    a.close(), b.close()


def test_with_trimming_a_hole_falls_back_to_the_last_checkpoints_window(daemon) -> None:
    """window_checkpoint_tokens 24: the sliding group holds keys 1, 2 (the window before 24) and 4, 5; without key
    5 the longest hit it can serve is 24 tokens (3 keys need keys 1 and 2), not 0."""
    a = HybridSide(daemon.address, make_caches(7, False), window_checkpoint_tokens=24)
    prompt, salt = prompt_tokens(PROMPT_LEN, start=16), "trim-hole"
    a.prefill(Req("r1", prompt, cache_salt=salt), SRC_TABLES)
    b = HybridSide(daemon.address, make_caches(8, False))
    assert lookup(b, prompt, salt, "q1") == 48
    with Client(daemon.address) as c:
        assert c.delete(namespace_for(SPECS[1], salt), chain(prompt)[5:6]) == 1
    assert lookup(b, prompt, salt, "q2") == 24
    assert b.sched.counters.totals["lookup_window_short_keys"] == 3
    a.close(), b.close()


@pytest.mark.parametrize(("chunks", "extra", "sliding_keys"), [((24, 26), {}, [4, 5]),
                                                               ((24, 26), {"window_checkpoint_tokens": 24}, [1, 2, 4, 5]),
                                                               ((20, 30), {"window_checkpoint_tokens": 24}, [1, 2, 4, 5])])
def test_a_chunked_prefill_saves_the_same_keys_as_one_step(daemon, chunks, extra, sliding_keys) -> None:
    """vLLM's chunked prefill: the first step sends the whole tables so far, the second only the new blocks (it
    never tells the connector which sliding-window blocks it handed back in between). Every key is saved once,
    in the step that completes it: the same keys and bytes as a one-step prefill. (20 then 30 tokens: key 2,
    tokens 16..23, completes in the second step; vLLM keeps its blocks, both after token 11.)"""
    a = HybridSide(daemon.address, make_caches(9, True), **extra)
    prompt, salt = prompt_tokens(PROMPT_LEN, start=17), f"chunked-{chunks}-{sorted(extra.items())}"
    req = Req("r1", prompt, cache_salt=salt)
    a.sched.track(req)
    first = -(-chunks[0] // BS)
    saved: list[list[int]] = [[], []]
    for n, tables, full_table in [(chunks[0], [t[:first] for t in SRC_TABLES], True),
                                  (chunks[1], [t[first:] for t in SRC_TABLES], False)]:
        plan = a.sched.build([ScheduledRequest("r1", tables, full_table, n)])
        req.num_computed_tokens += n                       # vLLM advances it after building the metadata
        a.worker.save(plan.saves)
        a.worker.drain()
        for job in plan.saves:
            for g, blocks in enumerate(job.block_ids):
                first_key = chain(prompt).index(job.keys[0])
                saved[g] += [first_key + i for i in range(len(job.keys)) if blocks[2 * i] >= 0]
    assert saved == [list(range(6)), sliding_keys]
    assert stored(daemon.address, salt) == expected_store(a.caches, chain(prompt), [list(range(6)), sliding_keys])
    a.close()


def test_a_load_after_vllms_own_prefix_hit_leaves_its_blocks_alone_in_every_group(daemon) -> None:
    """vLLM's own cache holds 12 tokens (3 blocks, inside key 1): the store adds 36; the job starts at key 1, with
    block 2 (vLLM's) untouched in both groups and the sliding group's null blocks skipped."""
    a = HybridSide(daemon.address, make_caches(10, True))
    prompt, salt = prompt_tokens(PROMPT_LEN, start=18), "local"
    a.prefill(Req("r1", prompt, cache_salt=salt), SRC_TABLES)
    b = HybridSide(daemon.address, make_caches(None, True))
    req = Req("r2", list(prompt), cache_salt=salt)
    assert b.sched.num_new_matched_tokens(req, 12) == (36, True)
    dst = [list(range(40, 53)), [0] * 9 + [54, 55, 56, 57]]
    b.sched.after_alloc(req, dst, 36)
    (job,) = b.sched.build([]).loads
    assert job.keys == chain(prompt)[1:6]
    assert job.block_ids == [[-1] + dst[0][3:12], [-1] * 7 + [54, 55, 56]]
    b.worker.start_loads([job])
    b.worker.drain()
    assert b.worker.finished(set()) == (set(), {"r2"}) and b.worker.load_errors() == set()
    assert holds_exactly(b.caches, a.caches, [zip(dst[0][3:12], SRC_TABLES[0][3:12]),
                                              zip([54, 55, 56], SRC_TABLES[1][9:12])])
    assert b.worker.counters.totals["loaded_blocks"] == 5 + 2
    a.close(), b.close()
