"""The daemon's own rules: its listeners, RPC limits, logs and sweeper, and the rules that tie two parts together.

Rules on one component's settings live with that component's config (EngineConfig, DiskConfig, PeerConfig,
the policy and admission factories); rules on TLS, tokens, etcd security and metrics labels in security.py.
What is left is here, each checked once by checks.validate().
"""

from __future__ import annotations

import math

from kvstore.addresses import parse_host_port
from kvstore.errors import ConfigError
from kvstore.fastpath.sockets import MAX_SPIN_US
from kvstore.policies.admission import check_write_mode
from kvstore.policies.write_budget import MAX_WINDOW_S, MIN_WINDOW_S, check_budget
from kvstore.server.config.settings import ServerConfig
from kvstore.server.heap import MAX_GEN0, MIN_GEN0

__all__ = ["require", "check_listeners", "check_arena", "check_disk_geometry", "check_restarts", "check_disk_writes"]

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
ARENA_LOCKS = ("auto", "on", "off")
FDSTORE_MODES = ("auto", "on", "off")
MAX_KEY_INDEX_ENTRIES = 1 << 26  # a 3 GiB table per tenant: past any arena's block count


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError("invalid config: " + message)


def _host_port(name: str, value: str, example: str) -> None:
    try:
        parse_host_port(value)
    except ValueError as exc:
        require(False, f"{name}={value!r}: {exc}; use host:port, e.g. {example}")


def check_listeners(cfg: ServerConfig) -> None:
    """Where the daemon listens, how much one RPC may carry, its threads, its logs and its sweeper."""
    require(bool(cfg.unix_socket or cfg.listen), "unix_socket and listen are both empty: enable at least one")
    if cfg.listen:
        _host_port("listen", cfg.listen, "127.0.0.1:7070")
    if cfg.metrics_listen:
        _host_port("metrics_listen", cfg.metrics_listen, "127.0.0.1:9464")
    require(cfg.sweep_interval_s > 0, f"sweep_interval_s={cfg.sweep_interval_s} must be > 0")
    require(cfg.max_message_bytes >= 1 << 20, "max_message_bytes must be at least 1MiB")
    require(1 <= cfg.grpc_workers <= 256, f"grpc_workers={cfg.grpc_workers}: use 1..256")
    require(0 <= cfg.fast_spin_us <= MAX_SPIN_US,
            f"fast_spin_us={cfg.fast_spin_us}: use 0 (never poll) to {MAX_SPIN_US} us")
    require(0 <= cfg.key_index_entries <= MAX_KEY_INDEX_ENTRIES,
            f"key_index_entries={cfg.key_index_entries}: use 0 (no shared key index) to {MAX_KEY_INDEX_ENTRIES}")
    require(0 <= cfg.max_subscribers < cfg.grpc_workers,
            f"max_subscribers={cfg.max_subscribers} must be below grpc_workers={cfg.grpc_workers}")
    require(cfg.log_level in LOG_LEVELS, f"log_level={cfg.log_level!r}: use debug, info, warning or error")
    require(cfg.log_format in LOG_FORMATS, f"log_format={cfg.log_format!r}: use text or json")
    require(cfg.gc_young_threshold == 0 or MIN_GEN0 <= cfg.gc_young_threshold <= MAX_GEN0,
            f"gc_young_threshold={cfg.gc_young_threshold}: use 0 (CPython's defaults) or {MIN_GEN0}..{MAX_GEN0}")


def check_arena(cfg: ServerConfig) -> None:
    """The arena holds at least two of the largest blocks (max_block_bytes itself: EngineConfig)."""
    require(cfg.arena_lock in ARENA_LOCKS, f"arena_lock={cfg.arena_lock!r}: use auto, on or off")
    require(cfg.arena_bytes >= 2 * cfg.max_block_bytes,
            f"arena_bytes={cfg.arena_bytes} must be at least 2 x max_block_bytes ({cfg.max_block_bytes})")


def check_disk_writes(cfg: ServerConfig) -> None:
    """When blocks are written and how fast (disk_write, the budget), and what makes no sense together."""
    check_write_mode(cfg.disk_write)
    window = cfg.disk_write_budget_window_s
    require(isinstance(window, (int, float)) and not isinstance(window, bool) and math.isfinite(window)
            and MIN_WINDOW_S <= window <= MAX_WINDOW_S,
            f"disk_write_budget_window_s={window!r}: use {MIN_WINDOW_S:g} to {MAX_WINDOW_S:g} seconds")
    budget = cfg.write_budget
    if budget is None:
        return
    check_budget(budget, window, cfg.max_block_bytes)
    require(cfg.disk_admission != "never",
            f"disk_write_budget={cfg.disk_write_budget!r} with disk_admission = never: nothing is ever offered to the "
            "disk, so the budget makes no sense; drop one of them")


def check_disk_geometry(cfg: ServerConfig) -> None:
    """A block spilled from RAM must fit in one disk segment (the rest of the geometry: DiskConfig)."""
    require(cfg.disk_segment_bytes >= cfg.max_block_bytes, "disk_segment_bytes must be at least max_block_bytes")


def check_restarts(cfg: ServerConfig) -> None:
    """A hand-over needs the unix socket (its hand-over socket sits beside it); bounded waits; fd store mode."""
    require(not cfg.take_over or bool(cfg.unix_socket),
            "take_over needs unix_socket: the running daemon is found at <unix_socket>.handover")
    require(1.0 <= cfg.handover_timeout_s <= 3600.0,
            f"handover_timeout_s={cfg.handover_timeout_s}: use 1..3600 seconds")
    require(cfg.fdstore in FDSTORE_MODES, f"fdstore={cfg.fdstore!r}: use auto, on or off")
