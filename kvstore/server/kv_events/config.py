"""The vLLM-format event publisher's settings, checked at construction (the daemon's kv_events_* keys).

Endpoints are bound by the daemon (never connected): ``tcp://HOST:PORT`` or
``ipc://PATH`` (created owner-only: the daemon runs with umask 077). Whether a non-loopback host may be bound
is a security rule (kvstore/server/config/security.py: the stream is unauthenticated); here only the form.

The topic is a template: ``{node}`` (node_id), ``{model}`` (the namespace's registered model, else its name),
``{namespace}`` and ``{tenant}``. The default ``kv@{node}@{model}`` is the form llm-d's KV-cache indexer reads a
pod and a model from; vLLM's own default topic is "" (set kv_events_topic = "" for one topic for everything).
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass

from kvstore.addresses import parse_host_port
from kvstore.errors import ConfigError

__all__ = ["KvEventsConfig", "TOPIC_FIELDS", "endpoint_host"]

TOPIC_FIELDS = ("node", "model", "namespace", "tenant")
MAX_TOPIC_CHARS = 256
_IPC = re.compile(r"^ipc://(/[^\x00]{1,100})$")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError("invalid config: " + message)


def endpoint_host(endpoint: str) -> str | None:
    """The host of a tcp:// endpoint (None for ipc://)."""
    return parse_host_port(endpoint[len("tcp://"):])[0] if endpoint.startswith("tcp://") else None


def _check_endpoint(name: str, endpoint: str) -> None:
    if endpoint.startswith("ipc://"):
        _require(bool(_IPC.match(endpoint)), f"{name}={endpoint!r}: an ipc endpoint is ipc:// and an absolute "
                 "path of at most 100 characters, e.g. ipc:///run/kvstore/events.sock")
        return
    _require(endpoint.startswith("tcp://"), f"{name}={endpoint!r}: use tcp://HOST:PORT (e.g. tcp://127.0.0.1:5557) "
             "or ipc:///PATH; the daemon binds it (a router's SUB socket connects)")
    try:
        host, _ = parse_host_port(endpoint[len("tcp://"):])
    except ValueError as exc:
        _require(False, f"{name}={endpoint!r}: {exc}; use tcp://HOST:PORT, e.g. tcp://127.0.0.1:5557")
    _require(host not in ("*", ""), f"{name}={endpoint!r}: name the address to bind (tcp://0.0.0.0:5557 for every "
             "interface, which needs allow_insecure_remote)")


@dataclass(frozen=True)
class KvEventsConfig:
    node_id: str
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str = ""
    topic: str = "kv@{node}@{model}"
    buffer_batches: int = 10_000
    hwm: int = 100_000
    queue_events: int = 100_000

    def __post_init__(self) -> None:
        _check_endpoint("kv_events_endpoint", self.endpoint)
        if self.replay_endpoint:
            _check_endpoint("kv_events_replay_endpoint", self.replay_endpoint)
            _require(self.replay_endpoint != self.endpoint,
                     "kv_events_replay_endpoint must differ from kv_events_endpoint")
        _require(len(self.topic) <= MAX_TOPIC_CHARS and self.topic.isprintable(),
                 f"kv_events_topic: at most {MAX_TOPIC_CHARS} printable characters")
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(self.topic) if f is not None]
        except ValueError as exc:
            raise ConfigError(f"invalid config: kv_events_topic={self.topic!r}: {exc} (write {{{{ and }}}} for "
                              "literal braces)") from exc
        unknown = [f for f in fields if f not in TOPIC_FIELDS]
        _require(not unknown, f"kv_events_topic={self.topic!r}: unknown field(s) {unknown}; use "
                 + ", ".join("{" + f + "}" for f in TOPIC_FIELDS))
        _require(1 <= self.buffer_batches <= 1_000_000,
                 f"kv_events_buffer_batches={self.buffer_batches}: use 1..1000000 (batches kept for replay)")
        _require(1 <= self.hwm <= 10_000_000, f"kv_events_hwm={self.hwm}: use 1..10000000 (batches queued for one "
                 "subscriber before the next one is dropped for it)")
        _require(16 <= self.queue_events <= 10_000_000,
                 f"kv_events_queue={self.queue_events}: use 16..10000000 (store events waiting for the publisher)")

    def could_match(self, prefix: bytes) -> bool:
        """Whether a subscription prefix can match a topic of this template: one that starts with what every
        topic starts with ({node} filled in, up to the first other field), or a beginning of that."""
        fixed, whole = "", True
        for literal, name, _, _ in string.Formatter().parse(self.topic):
            fixed += literal
            if name is None:
                continue
            if name != "node":
                whole = False
                break
            fixed += self.node_id
        start = fixed.encode()
        return start.startswith(prefix) or (not whole and prefix.startswith(start))

    def topic_for(self, namespace: str, model: str, tenant: str) -> str:
        return self.topic.format(node=self.node_id, model=model or namespace, namespace=namespace, tenant=tenant)
