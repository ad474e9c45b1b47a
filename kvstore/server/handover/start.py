"""What a daemon starts from: a running daemon's hand-over (take_over), else systemd's fd store, else nothing.

main.py asks `inherit` before it builds the Daemon; the Daemon then adopts what came (inherit.py checks it).
"""

from __future__ import annotations

import logging
import os

from kvstore.arena.layout import ArenaLayout
from kvstore.server.config import ServerConfig
from kvstore.server.handover.fdstore import Notifier, inherited_from_store, listen_fds
from kvstore.server.handover.inherit import Inherited
from kvstore.server.handover.protocol import handover_socket_path
from kvstore.server.handover.receiver import TakeOver, Wanted

__all__ = ["inherit", "arena_layout"]

log = logging.getLogger("kvstore.server")


def arena_layout(cfg: ServerConfig) -> ArenaLayout:
    """The arena a daemon of this config lays out (a predecessor's must match it to be adopted)."""
    return ArenaLayout.for_capacity(cfg.shm_name.lstrip("/"), cfg.arena_bytes, cfg.max_block_bytes)


def inherit(cfg: ServerConfig, notifier: Notifier) -> tuple[TakeOver | None, Inherited | None]:
    """What this daemon starts from: a running daemon's hand-over (take_over), else what systemd's fd store
    passed back, else nothing. TakeOverFailed when the running daemon serves on."""
    layout = arena_layout(cfg)
    isolated = bool(cfg.tokens_file)
    passed = listen_fds()
    takeover, inherited = None, None
    if cfg.take_over:
        wanted = Wanted(layout, isolated, cfg.key_index_entries, cfg.tokens_file, cfg.arena_lock)
        takeover = TakeOver.connect(handover_socket_path(cfg.unix_socket), wanted, cfg.handover_timeout_s)
        if takeover is not None:
            inherited = takeover.receive()
    if inherited is None and passed:
        inherited = inherited_from_store(layout, passed, isolated=isolated, lock=cfg.arena_lock)
    elif passed:
        for fds in passed.values():
            for fd in fds:
                os.close(fd)
    for name in passed:  # what systemd held of the previous daemon: this one stores its own (Daemon.start)
        notifier.remove(name)
    if inherited is not None and inherited.arena is None:
        log.warning("starting cold: the RAM tier of the previous daemon (%s) cannot be used: %s", inherited.source,
                    inherited.why)
        inherited.close_unused()
        inherited = None
    return takeover, inherited
