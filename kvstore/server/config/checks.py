"""`validate(cfg)`: every rule of a ServerConfig once, before anything is created.

The rules live where their concern does (the component configs ServerConfig builds, the policy and admission
factories, rules.py, security.py); this module only runs them in order. It sits above settings.py, rules.py and
security.py, which read a ServerConfig and never import this file or each other's callers: the config package's
imports point one way (tests/test_import_graph.py).
"""

from __future__ import annotations

from kvstore.engine.sessions import check_book_limits
from kvstore.policies.admission import make_admission
from kvstore.policies.factory import policy_class
from kvstore.server.config import rules, security
from kvstore.server.config.settings import ServerConfig
from kvstore.tiers.disk.config import check_disk_options

__all__ = ["validate"]


def validate(cfg: ServerConfig) -> ServerConfig:
    """`cfg` once every rule holds; ConfigError names the setting and how to fix it."""
    rules.check_listeners(cfg)
    cfg.engine_config()
    rules.check_arena(cfg)
    policy_class(cfg.policy)
    if cfg.disk_bytes:
        cfg.disk_config()
        rules.check_disk_geometry(cfg)
    else:
        check_disk_options(cfg.disk_sync, cfg.disk_codec, cfg.disk_probe_interval_s, cfg.disk_reinsert_hits)
    make_admission(cfg.disk_admission)
    rules.check_disk_writes(cfg)
    cfg.peer_config()
    cfg.kv_events_config()
    security.check_security(cfg)
    security.check_kv_events(cfg)
    security.check_etcd(cfg)
    security.check_metrics_labels(cfg)
    check_book_limits(cfg.session_book_max, cfg.session_book_keys)
    rules.check_restarts(cfg)
    return cfg
