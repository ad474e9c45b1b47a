"""The vLLM-format KV event publisher: the engine's events, as vLLM's, on a ZMQ socket routers subscribe to.

One thread owns both sockets and the Residency (residency.py). It takes the engine's events from an internal
subscription of the engine's EventBus (bounded: kv_events_queue), turns them into vLLM events, encodes one batch
per topic per pass (encoding.py) and sends vLLM's frames, (topic, 8-byte big-endian sequence number, payload),
with a sequence per topic, so a subscriber of one topic sees its batches numbered 0, 1, 2, ... as from a vLLM
publisher. Each topic's last kv_events_buffer_batches batches are kept for replay.

What can go wrong, and why the daemon never waits:
- the engine publishes under its lock by appending to the bounded subscription: never blocks. If this thread
  falls behind by more than kv_events_queue events, the bus drops them and says how many (a gap): the
  publisher counts them (`queue_dropped_events`), sends AllBlocksCleared on every topic that held blocks, forgets
  where blocks are, and stores a snapshot of what the engine holds (Engine.tier_keys) with the identities it
  knew, so subscribers start over from the truth instead of routing to blocks that are gone.
- a subscriber that never reads: batches queue for it (kv_events_hwm of them, then the kernel's socket buffers;
  a SUB whose process reads its socket but not its queue drops at its own RCVHWM, as libzmq does); once its
  queue is full it loses batches, the others keep getting them, and the publisher never waits: it sends from an
  XPUB with XPUB_NODROP without blocking, so a full queue answers EAGAIN; that stall is counted
  (`subscriber_stalls`) and the batch sent again lossy. libzmq then skips the full subscriber silently until it
  reads again (it tells nobody how many it skipped): the subscriber sees the gap in its topic's sequence
  numbers, and may replay.
- replay (kv_events_replay_endpoint, a ROUTER as vLLM's): a REQ sends the first sequence wanted as 8 bytes
  big-endian (vLLM's form; with several topics, send [topic, start] as two frames); it gets (topic, seq,
  payload) for every buffered batch from there, then vLLM's end marker (b"", -1 as 8 bytes, b""). A malformed
  request or an unknown topic gets the end marker alone, is counted and logged (once a minute).
- a subscription to a topic the template cannot produce: logged once per prefix, counted; nothing else changes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from kvstore.engine.events import GAP, STORED, Event, EventBus
from kvstore.errors import ConfigError
from kvstore.origins import BlockOrigin
from kvstore.server.kv_events.config import KvEventsConfig
from kvstore.server.kv_events.counters import COUNTERS
from kvstore.server.kv_events.encoding import encode_batch
from kvstore.server.kv_events.origin_book import OriginBook
from kvstore.server.kv_events.residency import Published, Residency
from kvstore.server.kv_events.vllm_events import AllBlocksCleared
from kvstore.vocab import Tier

__all__ = ["KvEventsPublisher", "END_SEQ"]

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker
PASS_EVENTS = 4096      # engine events taken in one pass (one batch per topic)
RESYNC_WAIT_S = 2.0     # how long a restarted daemon's first batch (what it holds) waits for a subscriber
IDLE_WAIT_S = 0.05      # how long the thread waits for an event before it services the sockets again

Snapshot = Callable[[], Iterable[tuple[str, list[bytes], list[bytes]]]]  # (namespace, RAM keys, disk keys)


class KvEventsPublisher:
    def __init__(self, cfg: KvEventsConfig, bus: EventBus, labels: Callable[[str], tuple[str, str]],
                 snapshot: Snapshot, origin_capacity: int = 1 << 16, bind: bool = True) -> None:
        """`labels(namespace)` -> (model, tenant) for its topic; `snapshot()` -> what the engine holds. `bind`
        False: the sockets are bound later by `bind_when_free` (a successor taking over, whose predecessor holds
        the endpoints until it exits)."""
        import zmq  # only with kv_events on: pyzmq is the `events` extra

        self.cfg = cfg
        self._bus = bus
        self._labels = labels
        self._snapshot = snapshot
        self.book = OriginBook(origin_capacity)
        self._restore: dict[tuple[str, bytes], BlockOrigin] = {}
        self.residency = Residency(self._topic_of, self._origin_of)
        self._seq: dict[str, int] = {}
        self._buffers: dict[str, deque[tuple[int, bytes]]] = {}
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._seen_prefixes: set[bytes] = set()
        self._refusal_logged = 0.0
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pub: Any = None
        self._replay: Any = None
        if bind:
            try:
                self._bind_all()
            except ConfigError:
                self._ctx.term()
                raise
        self._sub = bus.subscribe(capacity=cfg.queue_events, internal=True)
        self._stop = threading.Event()
        self._pass_lock = threading.Lock()  # a pass, or a hand-over reading the identities
        self._thread = threading.Thread(target=self._run, name="kvstore-kv-events", daemon=True)

    def _bind_all(self) -> None:
        """Both sockets bound, or neither (ConfigError naming the setting)."""
        zmq, cfg = self._zmq, self.cfg
        # options before bind: a listener copies them when it binds, and every connection gets that copy
        self._pub = self._bind(zmq.XPUB, cfg.endpoint, "kv_events_endpoint", {zmq.SNDHWM: cfg.hwm, zmq.XPUB_NODROP: 1})
        try:
            self._replay = (self._bind(zmq.ROUTER, cfg.replay_endpoint, "kv_events_replay_endpoint",
                                       {zmq.SNDHWM: 2 * (cfg.buffer_batches + 1)})  # a whole replay and its end
                            if cfg.replay_endpoint else None)
        except ConfigError:
            self._pub.close()
            self._pub = None
            raise

    def _bind(self, kind: int, endpoint: str, setting: str, options: dict[int, int]) -> Any:
        sock = self._ctx.socket(kind)
        sock.setsockopt(self._zmq.LINGER, 0)
        for option, value in options.items():
            sock.setsockopt(option, value)
        try:
            sock.bind(endpoint)
        except self._zmq.ZMQError as exc:
            sock.close()
            raise ConfigError(f"cannot bind {setting}={endpoint!r}: {exc}; choose a free address") from exc
        return sock

    def bind_when_free(self, wait_s: float) -> bool:
        """Bind the endpoints, trying again for up to `wait_s` while another process (the daemon this one took
        over from) still holds them. False, logged, when they stay taken: the daemon serves without events."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self._bind_all()
                return True
            except ConfigError as exc:
                if time.monotonic() >= deadline:
                    log.warning("KV events off: %s", exc)
                    return False
            time.sleep(0.05)

    # -- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Publish from now on. The first batch on each topic of what the store holds is AllBlocksCleared and
        then BlockStored for each block, per tier: a daemon that restarted with blocks (its disk tier, the RAM
        tier a hand-over or systemd's fd store kept) tells routers what it holds now, and that whatever they
        knew of its predecessor is gone. A fresh store publishes nothing here."""
        assert self._pub is not None, "bind before start"
        self._thread.start()
        log.info("KV events (vLLM format) on %s%s, topic %r", self.cfg.endpoint,
                 f", replay on {self.cfg.replay_endpoint}" if self._replay is not None else "", self.cfg.topic)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._sub.close()
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()
        self._ctx.term()

    def status(self) -> dict[str, int]:
        out = dict(self._counts)
        out["origins_kept"], out["origins_dropped"] = self.book.kept, self.book.dropped
        out["blocks"] = len(self.residency)
        return out

    # -- a hand-over ---------------------------------------------------------------------------------------
    def export_origins(self) -> list[tuple[str, bytes, BlockOrigin]]:
        """The vLLM identities of the blocks published as held (a hand-over carries them to the successor, whose
        first batches then name the blocks as its predecessor did)."""
        with self._pass_lock:
            return self.residency.origins()

    def restore_origins(self, items: list[tuple[str, bytes, BlockOrigin]]) -> None:
        """A predecessor's identities (before start): the first snapshot names its blocks by them."""
        self._restore.update(((ns, key), origin) for ns, key, origin in items)

    # -- identities (Annotate, on RPC threads) -------------------------------------------------------------
    def annotate(self, namespace: str, keys: list[bytes], origins: list[BlockOrigin]) -> int:
        return self.book.put(namespace, keys, origins)

    def _origin_of(self, namespace: str, key: bytes) -> BlockOrigin | None:
        return self.book.take(namespace, key) or self._restore.pop((namespace, key), None)

    def _topic_of(self, namespace: str) -> str:
        try:
            model, tenant = self._labels(namespace)
        except Exception:  # noqa: BLE001 - a namespace gone since its event: name it by itself
            model, tenant = "", ""
        return self.cfg.topic_for(namespace, model, tenant)

    # -- the thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with self._pass_lock:
                out = self._resync()
                if out:
                    heard = self._await_subscriber(RESYNC_WAIT_S)
                    log.info("KV events: what the store holds at start, %d events on %d topics (%s)", len(out),
                             len({t for t, _ in out}), "a subscriber is connected" if heard else
                             f"no subscriber within {RESYNC_WAIT_S:g}s: a late one can replay from sequence 0")
                self._send(out)
                self._restore = {}
        except Exception:  # noqa: BLE001 - as a pass's: logged, the publisher goes on
            log.exception("KV event publisher's first snapshot failed")
        while not self._stop.is_set():
            try:
                with self._pass_lock:
                    self._pass()
            except Exception:  # the publisher must outlive a bug in one pass; the log says what happened
                log.exception("KV event publisher pass failed")
                time.sleep(IDLE_WAIT_S)

    def _pass(self) -> None:
        events: list[Event] = []
        ev = self._sub.next(timeout_s=IDLE_WAIT_S)
        while ev is not None:
            events.append(ev)
            if len(events) >= PASS_EVENTS:
                break
            ev = self._sub.next(timeout_s=0)
        out: list[Published] = []
        for namespace, key in self.book.recent():  # identities of blocks held already: rename them
            if self.residency.media(namespace, key):
                origin = self.book.take(namespace, key)
                if origin is not None:
                    out += self.residency.annotate(namespace, key, origin)
        for ev in events:
            out += self._recover(ev.dropped) if ev.kind == GAP else self.residency.apply(ev)
        self._send(out)
        self._service()

    def _recover(self, dropped: int) -> list[Published]:
        self._counts["queue_dropped_events"] += dropped
        log.warning("KV event publisher fell %d store events behind (kv_events_queue=%d): AllBlocksCleared on every "
                    "topic, then what the store holds now", dropped, self.cfg.queue_events)
        out: list[Published] = [(t, AllBlocksCleared()) for t in self.residency.topics()]
        self._restore = self.residency.forget()
        out += self._held_now()
        self._restore = {}
        return out

    def _await_subscriber(self, wait_s: float) -> bool:
        """Up to `wait_s` for a first subscription: a PUB socket drops what it sends before any subscriber is
        connected, and after a restart routers reconnect on their own within ZMQ's reconnect interval."""
        zmq = self._zmq
        deadline = time.monotonic() + wait_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            if self._pub.poll(50, zmq.POLLIN):
                self._service()
                return True
        return False

    def _resync(self) -> list[Published]:
        """At start: AllBlocksCleared on each topic the store holds blocks of, then those blocks."""
        held = self._held_now()
        return [(t, AllBlocksCleared()) for t in sorted({t for t, _ in held})] + held

    def _held_now(self) -> list[Published]:
        out: list[Published] = []
        for namespace, ram, disk in self._snapshot():
            for keys, tier in ((ram, Tier.RAM), (disk, Tier.DISK)):
                if keys:
                    out += self.residency.apply(Event(0, time.time(), STORED, namespace, tuple(keys), int(tier)))
        return out

    def _send(self, out: list[Published]) -> None:
        by_topic: dict[str, list[Any]] = {}
        for topic, event in out:
            by_topic.setdefault(topic, []).append(event)
        zmq = self._zmq
        for topic, events in by_topic.items():
            seq = self._seq.get(topic, 0)
            self._seq[topic] = seq + 1
            frames = (topic.encode(), seq.to_bytes(8, "big"), encode_batch(time.time(), events))
            try:
                self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:  # a subscriber's queue is full: it loses this batch (and, silently, the next ones
                self._counts["subscriber_stalls"] += 1  # until it reads again); the others get it
                self._pub.setsockopt(zmq.XPUB_NODROP, 0)
                try:
                    self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
                finally:
                    self._pub.setsockopt(zmq.XPUB_NODROP, 1)
            buf = self._buffers.get(topic)
            if buf is None:
                buf = self._buffers[topic] = deque(maxlen=self.cfg.buffer_batches)
            buf.append((seq, frames[2]))
            self._counts["batches"] += 1
            self._counts["events"] += len(events)

    # -- subscriptions and replay ---------------------------------------------------------------------------
    def _service(self) -> None:
        zmq = self._zmq
        while self._pub.poll(0, zmq.POLLIN):
            self._subscription(self._pub.recv(zmq.NOBLOCK))
        while self._replay is not None and self._replay.poll(0, zmq.POLLIN):
            self._replay_request(self._replay.recv_multipart(zmq.NOBLOCK))

    def _subscription(self, msg: bytes) -> None:
        """XPUB hands over each new subscription (b"\x01" + prefix) and the last unsubscription of one. A prefix
        no topic of the template can start with (kv_events_topic) is counted and logged once."""
        if not msg or msg[0] != 1 or msg[1:] in self._seen_prefixes:
            return
        prefix = msg[1:]
        self._seen_prefixes.add(prefix)
        known = self.residency.known_topics()
        if not self.cfg.could_match(prefix) and not any(t.encode().startswith(prefix) for t in known):
            self._counts["unknown_topic_subscriptions"] += 1
            log.info("a KV event subscriber subscribed to topic %r, which no topic here can match (kv_events_topic="
                     "%r; topics so far: %s)", prefix, self.cfg.topic, ", ".join(map(repr, known[:8])) or "none")

    def _replay_request(self, frames: list[bytes]) -> None:
        assert self._replay is not None
        ident = frames[0]
        body = frames[2:] if len(frames) >= 2 and frames[1] == b"" else None
        topic: str | None = None
        why = ""
        if body is None or len(body) not in (1, 2) or len(body[-1]) != 8:
            why = "a request is the first sequence wanted, 8 bytes big-endian (or [topic, start])"
        elif len(body) == 2:
            topic = body[0].decode(errors="replace")
            if topic not in self._buffers:
                why = f"unknown topic {topic!r}"
        elif len(self._buffers) > 1:
            why = f"{len(self._buffers)} topics are published: send [topic, start] as two frames"
        else:
            topic = next(iter(self._buffers), None)  # None: nothing published yet, nothing to replay
        if why:
            self._refuse(why)
        else:
            start = int.from_bytes(body[-1], "big")  # type: ignore[index]  # body is set when why is empty
            for seq, payload in self._buffers[topic] if topic is not None else ():
                if seq >= start:
                    self._replay.send_multipart((ident, b"", topic.encode(),  # type: ignore[union-attr]
                                                 seq.to_bytes(8, "big"), payload), flags=self._zmq.NOBLOCK)
            self._counts["replay_requests"] += 1
        if body is not None:  # a REQ waits for an answer: always the end marker
            self._replay.send_multipart((ident, b"", b"", END_SEQ, b""), flags=self._zmq.NOBLOCK)

    def _refuse(self, why: str) -> None:
        self._counts["replay_refused"] += 1
        now = time.monotonic()
        if now - self._refusal_logged > 60:
            self._refusal_logged = now
            log.warning("KV event replay request refused: %s", why)
