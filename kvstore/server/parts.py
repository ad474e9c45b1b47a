"""Parts the composition root (main.py) builds from the config that need more than a constructor call.

Each is a function of the config and the parts it needs, so main.py stays a list of what is built in which order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvstore.arena.backing import ArenaBacking
from kvstore.engine.engine import Engine
from kvstore.errors import ConfigError
from kvstore.policies.write_budget import WriteBudget
from kvstore.peer import PeerCluster
from kvstore.server.config import ServerConfig
from kvstore.tiers.disk import BlockIO, DiskConfig, DiskStore
from kvstore.transfers import TransferMeter

if TYPE_CHECKING:
    from kvstore.server.kv_events.publisher import KvEventsPublisher

__all__ = ["kv_events_publisher", "open_disk", "peer_cluster", "write_budget"]


def write_budget(cfg: ServerConfig) -> WriteBudget | None:
    """The disk write budget (disk_write_budget), None for none. Seed 0: the replay's simulator drives the same
    class with the same seed (bench/replay)."""
    rate = cfg.write_budget
    if rate is None or not cfg.disk_bytes:
        return None
    return WriteBudget(rate, cfg.disk_write_budget_window_s, seed=0, max_block_bytes=cfg.max_block_bytes)


def kv_events_publisher(cfg: ServerConfig, engine: Engine, bind: bool) -> KvEventsPublisher:
    """The vLLM-format event publisher (kv_events): subscribed to the engine's events now, so nothing stored before
    its start is missed. With `bind` it binds its sockets now, so a taken address stops the daemon here; a
    successor taking over binds them in start_late, once the daemon it took over from has let go of them."""
    try:
        from kvstore.server.kv_events.publisher import KvEventsPublisher
    except ImportError as exc:
        raise ConfigError(f"kv_events = true needs pyzmq and msgpack ({exc}): pip install 'kvstore[events]'") from exc

    def snapshot() -> Iterator[tuple[str, list[bytes], list[bytes]]]:
        for ns in engine.stats().namespaces:
            yield (ns.name, *engine.tier_keys(ns.name))
    return KvEventsPublisher(cfg.kv_events_config(), engine.events, engine.namespace_labels, snapshot,
                             origin_capacity=max(1 << 16, 16 * cfg.max_batch_keys), bind=bind)


def open_disk(config: DiskConfig, transfers: TransferMeter, wipe: bool) -> DiskStore:
    """The disk tier, recovered or wiped, before any RPC is served (the store locks its directory)."""
    store = DiskStore(config, io=BlockIO(transfers=transfers))
    store.open(wipe=wipe)  # logs what it recovered
    return store


def peer_cluster(cfg: ServerConfig, arena: ArenaBacking, engine: Engine, with_disk: bool,
                 transfers: TransferMeter) -> PeerCluster:
    """The peer tier (etcd membership + data plane); started after the gRPC server, stopped before it. Its
    capacity (what placement weighs) is the arena's and, with a disk tier, the disk's."""
    capacity = arena.layout.data_bytes + (cfg.disk_bytes if with_disk else 0)
    return PeerCluster(cfg.peer_config(capacity), engine, arena.view, transfers)
