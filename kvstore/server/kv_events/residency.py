"""The engine's KV events turned into vLLM's, per topic: which block is in which medium, and what to announce.

Sans-IO and single-threaded (the publisher's thread owns it). The engine says what happened to kvstore keys, per
tier (kvstore/engine/events.py); vLLM's consumers index block hashes per medium. This keeps, for every
(namespace, key) it has seen stored, the media that hold it (RAM = "CPU", disk = "STORAGE") and its vLLM identity
(kvstore/origins.py; none: it is named by its key, flagged, vllm_events.py), and turns each engine event into
vLLM events:

    stored(tier)          the key lands in the medium: BlockStored of the keys not there yet
    moved(ram -> disk)    a RAM eviction of a block the disk keeps: is on disk (BlockStored if not announced
                          there yet), then leaves RAM (BlockRemoved)
    moved(disk -> ram)    a promotion: lands in RAM (BlockStored); the disk keeps its copy
    removed(tier)         leaves the medium (BlockRemoved): a RAM eviction, a delete, a disk reclamation
    removed(whole ns)     the namespace's blocks leave the medium (a clear): AllBlocksCleared when its topic then
                          holds nothing in any medium, else BlockRemoved of them

Several namespaces may share a topic (TP ranks of one model, tenants) and so store the same vLLM hashes: a hash
is counted per (topic, medium), announced when its count goes from 0 to 1 and removed when it goes back to 0,
so a consumer never sees a BlockRemoved for a hash the topic still holds in that medium, nor a duplicate store.

BlockStored runs: consecutive keys of one engine event whose vLLM identities chain (each key's parent hash is the
previous key's last hash, same LoRA and block size) become one BlockStored, as vLLM announces a request's new
blocks; flagged keys of one event go together in one (parent None, no tokens). `forget` drops everything but the
identities (the publisher's recovery after it lost events: publisher.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvstore.engine.events import GAP, MOVED, REMOVED, STORED, Event
from kvstore.origins import BlockOrigin
from kvstore.server.kv_events.vllm_events import (MEDIUM_DISK, MEDIUM_RAM, OWNER_KEY, OWNER_VLLM, AllBlocksCleared,
                                                  BlockRemoved, BlockStored, VllmEvent)
from kvstore.vocab import Tier

__all__ = ["Residency", "Published", "MEDIA"]

MEDIA = {int(Tier.RAM): MEDIUM_RAM, int(Tier.DISK): MEDIUM_DISK}
_BIT = {int(Tier.RAM): 1, int(Tier.DISK): 2}

Published = tuple[str, VllmEvent]  # (topic, event)


@dataclass
class _Block:
    topic: str
    origin: BlockOrigin | None
    media: int = 0  # bit 1: RAM, bit 2: disk

    @property
    def hashes(self) -> tuple[bytes, ...]:
        return self.origin.block_hashes if self.origin is not None else ()


@dataclass
class _Topic:
    refs: dict[tuple[int, bytes], int] = field(default_factory=dict)  # (medium bit, hash) -> holders
    held: int = 0                                                     # (key, medium) pairs on this topic


class Residency:
    """`apply(event)` -> the vLLM events it means, in order. `topic_of(namespace)` names a namespace's topic;
    `origin_of(namespace, key)` hands over the identity a client sent before the put (None: flagged)."""

    def __init__(self, topic_of: Callable[[str], str],
                 origin_of: Callable[[str, bytes], BlockOrigin | None]) -> None:
        self._topic_of = topic_of
        self._origin_of = origin_of
        self._blocks: dict[tuple[str, bytes], _Block] = {}
        self._by_ns: dict[str, set[bytes]] = {}
        self._topics: dict[str, _Topic] = {}
        self._ns_topic: dict[str, str] = {}  # a namespace's topic, fixed at first use for the daemon's life

    # -- queries ------------------------------------------------------------------------------------------
    def media(self, namespace: str, key: bytes) -> int:
        """The media bits holding the key (0: none known)."""
        b = self._blocks.get((namespace, key))
        return b.media if b is not None else 0

    def topics(self) -> list[str]:
        """Topics that hold at least one block now."""
        return [t for t, st in self._topics.items() if st.held]

    def known_topics(self) -> list[str]:
        """Every topic a namespace has published on."""
        return list(dict.fromkeys(self._ns_topic.values()))

    def __len__(self) -> int:
        return len(self._blocks)

    # -- the engine's events --------------------------------------------------------------------------------
    def apply(self, ev: Event) -> list[Published]:
        if ev.kind == STORED:
            return self._stored(ev.namespace, ev.keys, _BIT[ev.tier])
        if ev.kind == MOVED and ev.tier == Tier.DISK:  # a promotion: the disk keeps its copy
            return self._stored(ev.namespace, ev.keys, _BIT[ev.to_tier])
        if ev.kind == MOVED:  # a RAM eviction of a block the disk keeps: on disk first (its identity stays with
            return (self._stored(ev.namespace, ev.keys, _BIT[ev.to_tier])  # a block held somewhere), then out of RAM
                    + self._removed(ev.namespace, ev.keys, _BIT[ev.tier]))
        if ev.kind == REMOVED and ev.whole_namespace:
            return self._cleared(ev.namespace, _BIT[ev.tier])
        if ev.kind == REMOVED:
            return self._removed(ev.namespace, ev.keys, _BIT[ev.tier])
        if ev.kind == GAP:
            raise ValueError("a gap is the publisher's to handle (forget, then a snapshot)")
        return []

    def annotate(self, namespace: str, key: bytes, origin: BlockOrigin) -> list[Published]:
        """A key already held got (another) vLLM identity: its old name leaves every medium, the new one arrives
        (keys not held yet take theirs when stored: `origin_of`). Nothing when the identity is the same."""
        b = self._blocks.get((namespace, key))
        if b is None or b.origin == origin:
            return []
        held, out = b.media, []
        for bit in (1, 2):
            if held & bit:
                out += self._removed(namespace, (key,), bit)
        b = self._block(namespace, key)  # the old one went with its last medium
        b.origin = origin
        for bit in (1, 2):
            if held & bit:
                out += self._stored(namespace, (key,), bit)
        return out

    def origins(self) -> list[tuple[str, bytes, BlockOrigin]]:
        """(namespace, key, vLLM identity) of every held block that has one."""
        return [(ns, key, b.origin) for (ns, key), b in self._blocks.items() if b.origin is not None]

    def forget(self) -> dict[tuple[str, bytes], BlockOrigin]:
        """Drop what is held where (the publisher lost events); the vLLM identities known so far are returned,
        to be handed back by `origin_of` when a snapshot stores the blocks again."""
        kept = {k: b.origin for k, b in self._blocks.items() if b.origin is not None}
        self._blocks.clear()
        self._by_ns.clear()
        self._topics.clear()
        return kept

    # -- internals ----------------------------------------------------------------------------------------
    def _topic(self, namespace: str) -> str:
        t = self._ns_topic.get(namespace)
        if t is None:
            t = self._ns_topic[namespace] = self._topic_of(namespace)
        return t

    def _block(self, namespace: str, key: bytes) -> _Block:
        b = self._blocks.get((namespace, key))
        if b is None:
            b = self._blocks[(namespace, key)] = _Block(self._topic(namespace), self._origin_of(namespace, key))
            self._by_ns.setdefault(namespace, set()).add(key)
        return b

    def _names(self, key: bytes, b: _Block) -> tuple[bytes, ...]:
        return b.hashes or (key,)

    def _stored(self, namespace: str, keys: Iterable[bytes], bit: int) -> list[Published]:
        medium = MEDIUM_RAM if bit == 1 else MEDIUM_DISK
        runs: list[list[tuple[bytes, _Block]]] = []
        for key in keys:
            b = self._block(namespace, key)
            if b.media & bit:
                continue
            b.media |= bit
            st = self._topics.setdefault(b.topic, _Topic())
            st.held += 1
            fresh = False
            for h in self._names(key, b):
                n = st.refs.get((bit, h), 0)
                st.refs[(bit, h)] = n + 1
                fresh = fresh or n == 0
            if fresh:
                if runs and _continues(runs[-1][-1][1], b):
                    runs[-1].append((key, b))
                else:
                    runs.append([(key, b)])
        return [(run[0][1].topic, _stored_event(run, medium)) for run in runs]

    def _removed(self, namespace: str, keys: Iterable[bytes], bit: int) -> list[Published]:
        medium = MEDIUM_RAM if bit == 1 else MEDIUM_DISK
        gone: dict[tuple[str, str], list[bytes]] = {}  # (topic, ownership) -> hashes whose count reached 0
        for key in keys:
            b = self._blocks.get((namespace, key))
            if b is None or not b.media & bit:
                continue
            b.media &= ~bit
            st = self._topics[b.topic]
            st.held -= 1
            for h in self._names(key, b):
                n = st.refs[(bit, h)] - 1
                if n:
                    st.refs[(bit, h)] = n
                else:
                    del st.refs[(bit, h)]
                    gone.setdefault((b.topic, OWNER_VLLM if b.origin else OWNER_KEY), []).append(h)
            if not b.media:
                del self._blocks[(namespace, key)]
                self._by_ns[namespace].discard(key)
        return [(topic, BlockRemoved(tuple(hs), medium, owner)) for (topic, owner), hs in gone.items()]

    def _cleared(self, namespace: str, bit: int) -> list[Published]:
        keys = list(self._by_ns.get(namespace, ()))
        topic = self._topic(namespace)
        out = self._removed(namespace, keys, bit)
        if not self._topics.get(topic, _Topic()).held:
            return [(topic, AllBlocksCleared())]
        return out


def _continues(prev: _Block, b: _Block) -> bool:
    """Whether block b follows prev in one chain (one BlockStored): both named by vLLM hashes, b's parent is
    prev's last hash, same LoRA and block size; or both flagged."""
    p, o = prev.origin, b.origin
    if p is None or o is None:
        return p is None and o is None
    return (o.parent_block_hash == p.block_hashes[-1] and o.lora_name == p.lora_name
            and o.block_size == p.block_size and bool(o.token_ids) == bool(p.token_ids))


def _stored_event(run: list[tuple[bytes, _Block]], medium: str) -> BlockStored:
    first = run[0][1].origin
    if first is None:
        return BlockStored(tuple(k for k, _ in run), None, (), 0, medium, None, OWNER_KEY)
    hashes = tuple(h for _, b in run for h in b.hashes)
    tokens = tuple(t for _, b in run for t in (b.origin.token_ids if b.origin is not None else ()))
    return BlockStored(hashes, first.parent_block_hash, tokens, first.block_size, medium, first.lora_name, OWNER_VLLM)
