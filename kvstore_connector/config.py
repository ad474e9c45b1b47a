"""The connector's typed configuration, parsed once from ``kv_connector_extra_config``.

vLLM hands the connector a free-form dict. Every key is checked here, at construction, in both the scheduler
and the worker process, so a typo or a bad value stops ``vllm serve`` at startup with a message that says
what to write instead, rather than turning into silent misses an hour later.

Keys (all optional)::

    address            kvstore-server address: a unix socket path or host:port (default: the rule the daemon's
                       client and CLI follow too: $KVSTORE_ADDRESS, else the daemon's default socket,
                       $XDG_RUNTIME_DIR/kvstore.sock or /tmp/kvstore-$UID/kvstore.sock; kvstore/paths.py)
    save               "prompt" (default: full blocks of the prompt), "all" (also generated tokens), "off"
    load               true (default) / false: offer stored prefixes to the scheduler
    tails              true (default) / false: also store a finished request's partial last block and offer it
                       to a request that continues those tokens (an agent's next turn then recomputes nothing
                       of its context; kvstore_connector/tails.py). Where one stored block is one vLLM block and the
                       model has one KV cache group
    load_mode          "auto" (default): a hit held in this node's RAM loads synchronously, in the step that
                       schedules the request (a memcpy of its blocks before the forward), and so does one whose
                       blocks to read from disk or fetch from a peer total at most sync_fetch_bytes; a larger
                       one loads asynchronously (the request waits in WAITING_FOR_REMOTE_KVS while it is
                       promoted or fetched, and the steps of other requests go on). "sync", "async": always.
                       Why: an asynchronous load costs the request at least one more engine step, and a
                       busy engine's step (other requests' prefill) is far longer than copying a hit from RAM
    sync_fetch_bytes   with load_mode "auto": the most bytes a synchronous load may read from disk or fetch
                       from peers (every TP rank and pipeline stage together; blocks vLLM already holds do not
                       count). The step waits for them, so every running request's next token waits too:
                       16 MiB is ~2-5 ms at NVMe or 25-100 Gb/s network speed, under one busy step. 0: only
                       hits all in this node's RAM load synchronously (16777216)
    claim_ms           a lookup that misses claims the keys this server is about to compute for this long, and one
                       that misses keys another server (or another vLLM on this node) claimed waits up to this
                       long for that server's save, then loads them, instead of computing them too
                       (kvstore_connector/claims.py). With load_mode "auto" or "async", one KV cache group
                       and save not "off". 0: no claims (5000)
    lookup_timeout_s   deadline of the scheduler's prefix Lookup; a slow store costs hits, never latency (1.0)
    load_timeout_s     deadline of the worker's load and save RPCs; on expiry the load fails -> recompute (10.0)
    blocks_per_key     vLLM blocks per stored block, or "auto" (default): the fewest whose bytes reach
                       min_transfer_bytes, so one transfer unit is at least ~0.5 MiB
    min_transfer_bytes target bytes of one stored block for "auto" (524288)
    max_blocks_per_key cap for "auto" (16): a stored block is the unit of a hit, so bigger means coarser hits
    key_seed           seed of the chained block hash (0); change it to start a fresh key space
    model_id           name used in the namespace instead of vLLM's model path (e.g. when paths differ per node)
    copy_threads       threads of the native CPU copy (2)
    window_save        hybrid models (sliding-window or chunked-local KV cache groups): "trim" (default) stores
                       of such a group only the blocks a later hit can use (the window before the prompt's end
                       and before every window_checkpoint_tokens), "all" every block
    window_checkpoint_tokens
                       with "trim": also keep the window before every this many tokens (8192), so a request
                       that shares only part of a long prompt (a forked sub-agent) still hits; 0: prompt ends only
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from kvstore.engine.claims import MAX_CLAIM_MS
from kvstore.errors import ConfigError

__all__ = ["ConnectorConfig", "SAVE_POLICIES", "LOAD_MODES", "WINDOW_SAVES"]

SAVE_POLICIES = ("prompt", "all", "off")
LOAD_MODES = ("auto", "sync", "async")
WINDOW_SAVES = ("trim", "all")


def _bool(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false", "1", "0", "yes", "no"):
        return v.lower() in ("true", "1", "yes")
    raise ConfigError(f"kv_connector_extra_config.{name}={v!r}: use true or false")


def _number(name: str, v: Any, kind: type, lo: float, hi: float) -> Any:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ConfigError(f"kv_connector_extra_config.{name}={v!r}: expected a number in [{lo}, {hi}]")
    try:
        x = kind(v)
    except (TypeError, ValueError):
        raise ConfigError(f"kv_connector_extra_config.{name}={v!r}: expected a number in [{lo}, {hi}]") from None
    if kind is int and isinstance(v, float) and v != int(v):
        raise ConfigError(f"kv_connector_extra_config.{name}={v!r}: expected a whole number in [{lo}, {hi}]")
    if not lo <= x <= hi:
        raise ConfigError(f"kv_connector_extra_config.{name}={v!r} is out of range: use a value in [{lo}, {hi}]")
    return x


@dataclass(frozen=True)
class ConnectorConfig:
    address: str | None = None
    save: str = "prompt"
    load: bool = True
    tails: bool = True
    load_mode: str = "auto"
    sync_fetch_bytes: int = 16 << 20
    claim_ms: int = 5000
    lookup_timeout_s: float = 1.0
    load_timeout_s: float = 10.0
    blocks_per_key: int | None = None  # None = auto
    min_transfer_bytes: int = 512 * 1024
    max_blocks_per_key: int = 16
    key_seed: int = 0
    model_id: str = ""
    copy_threads: int = 2
    window_save: str = "trim"
    window_checkpoint_tokens: int = 8192

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """Validate vLLM's kv_connector_extra_config; unknown keys are errors (they are usually typos)."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config key(s) {unknown} for KVStoreConnector: "
                f"known keys are {sorted(known)}"
            )
        kw: dict[str, Any] = {}
        if "address" in extra and extra["address"] not in (None, ""):
            a = extra["address"]
            if not isinstance(a, str):
                raise ConfigError(f"kv_connector_extra_config.address={a!r}: use a socket path or host:port string")
            kw["address"] = os.path.expanduser(a)
        if "save" in extra:
            if extra["save"] not in SAVE_POLICIES:
                raise ConfigError(f"kv_connector_extra_config.save={extra['save']!r}: use one of {SAVE_POLICIES}")
            kw["save"] = extra["save"]
        if "window_save" in extra:
            if extra["window_save"] not in WINDOW_SAVES:
                raise ConfigError(f"kv_connector_extra_config.window_save={extra['window_save']!r}: use one of "
                                  f"{WINDOW_SAVES}")
            kw["window_save"] = extra["window_save"]
        for name in ("load", "tails"):
            if name in extra:
                kw[name] = _bool(name, extra[name])
        if "load_mode" in extra:
            if extra["load_mode"] not in LOAD_MODES:
                raise ConfigError(f"kv_connector_extra_config.load_mode={extra['load_mode']!r}: use one of "
                                  f"{LOAD_MODES}")
            kw["load_mode"] = extra["load_mode"]
        for name, lo, hi in (("lookup_timeout_s", 0.01, 60.0), ("load_timeout_s", 0.1, 600.0)):
            if name in extra:
                kw[name] = _number(name, extra[name], float, lo, hi)
        if "blocks_per_key" in extra and extra["blocks_per_key"] not in ("auto", None):
            kw["blocks_per_key"] = _number("blocks_per_key", extra["blocks_per_key"], int, 1, 1024)
        for name, lo, hi in (("min_transfer_bytes", 4096, 1 << 30), ("max_blocks_per_key", 1, 1024),
                             ("sync_fetch_bytes", 0, 1 << 40), ("claim_ms", 0, MAX_CLAIM_MS),
                             ("key_seed", 0, (1 << 64) - 1), ("copy_threads", 1, 64),
                             ("window_checkpoint_tokens", 0, 1 << 24)):
            if name in extra:
                kw[name] = _number(name, extra[name], int, lo, hi)
        if "model_id" in extra:
            if not isinstance(extra["model_id"], str):
                raise ConfigError(f"kv_connector_extra_config.model_id={extra['model_id']!r}: use a string")
            kw["model_id"] = extra["model_id"]
        return cls(**kw)

    def resolve_blocks_per_key(self, block_bytes: int) -> int:
        """vLLM blocks per stored block: fixed, or the fewest reaching min_transfer_bytes (capped)."""
        if block_bytes <= 0:
            raise ConfigError(f"KV block size is {block_bytes} bytes: the model has no KV cache to store")
        if self.blocks_per_key is not None:
            return self.blocks_per_key
        need = -(-self.min_transfer_bytes // block_bytes)
        return max(1, min(self.max_blocks_per_key, need))
