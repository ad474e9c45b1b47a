"""Agent hints in the connector: read from a request, aimed at keys, sent to the daemon off vLLM's thread.

Two ways in, one internal form (`Hint`: an action of kvstore/hint_vocab.py, ttl_s, one target):

- ``kv_transfer_params`` (the OpenAI server passes the request's field through)::

      {"kvstore_session": "s1",                       # optional: the session this request belongs to
       "kvstore_hints": [{"action": "retain", "ttl_s": 30, "session": "s1"},
                         {"action": "release", "keys": ["<32 hex digits>", ...]},
                         {"action": "pin", "ttl_s": 60, "tokens": [1, 2, 3, ...]},
                         {"action": "prefetch"}]}

- vLLM's ``Request.kv_hints`` (`KvHintsEnvelope`): one `KvHintAction` per hint, ``action_type`` the action
  (``"retain"`` or ``"kvstore.retain"``), ``action_version`` ``"1"``, ``payload`` the other fields above
  (``{"ttl_s": 30, "session": "s1"}``; ``"kvstore_session"`` in a payload names the request's session too).

A hint has ``action`` (retain, release, demote, prefetch, pin), ``ttl_s`` (seconds >= 0, default 0; retain and
pin need > 0) and at most one target: ``session`` (the chain of keys of that session's latest finished request),
``keys`` (block keys as 32 hex digits), ``tokens`` (token ids from the start of a sequence: the keys of its full
blocks, chained from this request's own root: its LoRA and multimodal inputs), or none: this request's own
stored blocks. Any other field, a wrong type or an unknown action makes the hint malformed: counted
(``hint_malformed``), logged once, and dropped; vLLM's request goes on unchanged.

Sessions: a request belongs to ``kvstore_session``, else to the session its first session hint other than a
release names. When it finishes (vLLM's request_finished: its prompt's blocks are saved by then) its session's
chain becomes the request's stored keys (unless it stored none), and then its hints run, in order. Every key counts how many live sessions hold it, so a
Release aimed at a session (or at keys/tokens) lets go only of keys no other live session holds: forked
sub-agents keep their shared head, the released branch's private tail goes first. Releasing a session ends it.
At most ``max_sessions`` are remembered (the least recently used goes).

Session notes: the daemon keeps a session book of its own (kvstore/engine/sessions.py) so that `kvstore explain
--session S` can answer after the fact. Each time a named session's chain is set, and when a Release ends the
session, a note goes on the same background queue as the hints (in order with them, never on vLLM's thread):
one `Client.note_session` per shard namespace, with the chain's head of at most the client's max_batch_keys.
Counted per namespace: ``session_noted``, ``session_note_failed`` (store down, an error, a client without
note_session); a note lost to a full queue counts as ``hint_dropped``. Notes never raise into vLLM.

Execution: each hint is one job (its shard namespaces, keys, action, ttl) on a bounded queue read by one
background thread, which asks `Client.hint` once per shard namespace (every stage, TP rank and KV cache group)
and counts one outcome per key and namespace: ``hint_accepted``, ``hint_clipped``, ``hint_deferred``,
``hint_rejected``, ``hint_missing``. ``hint_failed``: keys x namespaces whose call failed (store down, an error,
a client without hint); ``hint_dropped``: hints lost to a full queue; ``hint_empty``: hints with no key to act
on (an unknown session, a prompt shorter than a block). A block whose save is still in flight when its hint
runs (reserved and gathered in the step, its Commit pending on the worker's commit thread) answers
``deferred``: the daemon applies the hint when the Commit lands.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore_connector.background import Background
from kvstore_connector.counter_names import HINT_COUNTERS
from kvstore_connector.keys import KeyChain
from kvstore_connector.stats import ConnectorCounters
from kvstore.hint_vocab import HintAction, HintOutcome

if TYPE_CHECKING:
    from kvstore_connector.link import StoreLink
    from kvstore.client import Client

__all__ = ["Hint", "HintError", "HintSessions", "HINT_COUNTERS", "HINTS_PARAM", "SESSION_PARAM", "parse_hint",
           "request_hints"]

log = logging.getLogger(__name__)

HINTS_PARAM = "kvstore_hints"      # kv_transfer_params: the list of hints
SESSION_PARAM = "kvstore_session"  # kv_transfer_params (or an envelope payload): the request's session
ACTION_PREFIX = "kvstore."         # an envelope's action_type may carry it
ACTION_VERSION = "1"
KEY_BYTES = 16
_FIELDS = frozenset({"action", "ttl_s", "session", "keys", "tokens"})
_ACTIONS = ", ".join(a.value for a in HintAction)



class HintError(ValueError):
    """A malformed hint: the message says what to send instead."""


@dataclass(frozen=True)
class Hint:
    """One hint; no target (session, keys and tokens all None) means the request's own stored blocks."""

    action: HintAction
    ttl_s: float = 0.0
    session: str | None = None
    keys: tuple[bytes, ...] | None = None
    tokens: tuple[int, ...] | None = None


def parse_hint(obj: Any) -> Hint:
    """A hint from its JSON form (module docstring); HintError says what is wrong."""
    if not isinstance(obj, Mapping):
        raise HintError(f"a hint is an object like {{\"action\": \"retain\", \"ttl_s\": 30}}, got {obj!r}")
    extra = set(obj) - _FIELDS
    if extra:
        raise HintError(f"unknown hint field(s) {sorted(map(str, extra))}: use {sorted(_FIELDS)}")
    try:
        action = HintAction(str(obj.get("action", "")).lower())
    except ValueError:
        raise HintError(f"unknown hint action {obj.get('action')!r}: use one of {_ACTIONS}") from None
    ttl = obj.get("ttl_s", 0.0)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or ttl < 0:
        raise HintError(f"hint ttl_s={ttl!r}: use a finite number of seconds >= 0")
    if action in (HintAction.RETAIN, HintAction.PIN) and ttl <= 0:
        raise HintError(f"hint {action.value} needs ttl_s > 0 (how long to keep the blocks)")
    targets = [t for t in ("session", "keys", "tokens") if obj.get(t) is not None]
    if len(targets) > 1:
        raise HintError(f"a hint names one target, got {targets}: send one hint per target")
    session = obj.get("session")
    if session is not None and (not isinstance(session, str) or not session):
        raise HintError(f"hint session={session!r}: use a non-empty string")
    return Hint(action, float(ttl), session, _keys(obj.get("keys")), _tokens(obj.get("tokens")))


def _keys(raw: Any) -> tuple[bytes, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw:
        raise HintError(f"hint keys: use a non-empty list of {2 * KEY_BYTES}-hex-digit block keys, got {raw!r}")
    out = []
    for k in raw:
        try:
            b = bytes.fromhex(k) if isinstance(k, str) else b""
        except ValueError:
            b = b""
        if len(b) != KEY_BYTES:
            raise HintError(f"hint key {k!r}: a block key is {2 * KEY_BYTES} hex digits")
        out.append(b)
    return tuple(out)


def _tokens(raw: Any) -> tuple[int, ...] | None:
    if raw is None:
        return None
    if (not isinstance(raw, list) or not raw
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**63 for t in raw)):
        raise HintError("hint tokens: use a non-empty list of token ids (ints >= 0)")
    return tuple(raw)


def _from_envelope(action: Any) -> Hint:
    """One KvHintAction (vllm/v1/kv_hints) as a hint."""
    kind = str(getattr(action, "action_type", "")).lower().removeprefix(ACTION_PREFIX)
    version = str(getattr(action, "action_version", ""))
    if version != ACTION_VERSION:
        raise HintError(f"hint action_version {version!r}: this connector reads version {ACTION_VERSION!r}")
    payload = getattr(action, "payload", None)
    if not isinstance(payload, Mapping) or "action" in payload:
        raise HintError(f"hint payload {payload!r}: an object of ttl_s and one target (the action is action_type)")
    return parse_hint({**{k: v for k, v in payload.items() if k != SESSION_PARAM}, "action": kind})


def request_hints(request: Any) -> tuple[list[Hint], str | None, list[str]]:
    """(the request's hints, its session, why each malformed one was dropped), from its kv_transfer_params and
    its kv_hints envelope; never raises."""
    hints: list[Hint] = []
    errors: list[str] = []
    session: str | None = None
    params = getattr(request, "kv_transfer_params", None)
    raw: list[Any] = []
    if isinstance(params, Mapping):
        session = _session(params.get(SESSION_PARAM), errors)
        got = params.get(HINTS_PARAM)
        if got is not None and not isinstance(got, list):
            errors.append(f"kv_transfer_params[{HINTS_PARAM!r}] must be a list of hints, got {type(got).__name__}")
        raw = got if isinstance(got, list) else []
    for obj in raw:
        try:
            hints.append(parse_hint(obj))
        except HintError as exc:
            errors.append(str(exc))
    envelope = getattr(request, "kv_hints", None)
    actions = getattr(envelope, "actions", None) if envelope is not None else None
    for act in actions if isinstance(actions, (list, tuple)) else ():
        payload = getattr(act, "payload", None)
        if session is None and isinstance(payload, Mapping):
            session = _session(payload.get(SESSION_PARAM), errors)
        try:
            hints.append(_from_envelope(act))
        except HintError as exc:
            errors.append(str(exc))
    if session is None:
        session = next((h.session for h in hints if h.session is not None and h.action is not HintAction.RELEASE),
                       None)
    return hints, session, errors


def _session(raw: Any, errors: list[str]) -> str | None:
    if raw is None or (isinstance(raw, str) and raw):
        return raw
    errors.append(f"{SESSION_PARAM}={raw!r}: use a non-empty string")
    return None


@dataclass(frozen=True)
class _Job:
    namespaces: tuple[str, ...]
    keys: tuple[bytes, ...]
    action: HintAction
    ttl_s: float


@dataclass(frozen=True)
class _Note:
    """A session's chain (or its end) for the daemon's session book, one per shard namespace when sent."""

    namespaces: tuple[str, ...]
    session: str
    keys: tuple[bytes, ...]  # () with ended: the book keeps the chain it has
    ended: bool


def _hint_call(ns: str, job: _Job) -> Callable[[Client], list[HintOutcome]]:
    return lambda c: c.hint(ns, list(job.keys), job.action, job.ttl_s)


def _note_call(ns: str, note: _Note) -> Callable[[Client], bool]:
    return lambda c: c.note_session(ns, note.session, list(note.keys[:c.max_batch_keys]), ended=note.ended)


class HintSessions:
    """Session chains, key reference counts and the thread that sends hints (module docstring). The scheduler's
    thread calls `finished`; the background thread only calls the store and counts."""

    def __init__(self, link: StoreLink, counters: ConnectorCounters, *, tokens_per_key: int, key_seed: int,
                 capacity: int = 1024, max_sessions: int = 4096, idle_s: float = 30.0) -> None:
        """``capacity``: hints waiting for the store at most (more are dropped and counted); ``idle_s``: the
        thread ends after this long without a hint (the next one starts it again)."""
        self.link, self.counters = link, counters
        self.tokens_per_key, self.key_seed = tokens_per_key, key_seed
        self.max_sessions = max_sessions
        self._chains: OrderedDict[str, tuple[tuple[str, ...], tuple[bytes, ...]]] = OrderedDict()
        self._refs: Counter[tuple[tuple[str, ...], bytes]] = Counter()  # (namespaces, key) -> live sessions
        self._jobs: Background[_Job | _Note] = Background("kvstore-hints", self._run, capacity=capacity, idle_s=idle_s,
                                                  one_at_a_time=True)
        self._logged: set[str] = set()

    # -- the scheduler's thread ------------------------------------------------------------------------
    def chain(self, session: str) -> tuple[bytes, ...]:
        """The keys a live session holds (its latest finished request's), empty when unknown."""
        got = self._chains.get(session)
        return got[1] if got is not None else ()

    def refs(self, namespaces: Sequence[str], key: bytes) -> int:
        """How many live sessions hold ``key`` in these shard namespaces."""
        return self._refs[(tuple(namespaces), key)]

    def finished(self, request: Any, namespaces: Sequence[str], keys: Sequence[bytes], root: bytes) -> None:
        """A request ended: remember its session's chain, then queue its hints. Never raises."""
        try:
            hints, session, errors = request_hints(request)
            if errors:
                self.counters.add(hint_malformed=len(errors))
                self._log_once("malformed", "kvstore connector: request %s: dropped malformed hint(s): %s "
                               "(see kvstore_connector/hints.py for the format)", request.request_id, "; ".join(errors))
            ns = tuple(namespaces)
            if session is not None and keys:
                self._set_chain(session, ns, tuple(keys))
            for h in hints:
                self._run_hint(h, ns, tuple(keys), root, session)
        except Exception:  # noqa: BLE001 - a hint never fails vLLM's request
            self.counters.add(hint_malformed=1)
            log.exception("kvstore connector: the hints of request %s failed", getattr(request, "request_id", "?"))

    def _set_chain(self, session: str, ns: tuple[str, ...], keys: tuple[bytes, ...]) -> None:
        self._drop_session(session)
        self._chains[session] = (ns, keys)
        self._refs.update((ns, k) for k in keys)
        while len(self._chains) > self.max_sessions:
            self._drop_session(next(iter(self._chains)))
        self._submit(_Note(ns, session, keys, False))

    def _drop_session(self, session: str) -> None:
        old = self._chains.pop(session, None)
        if old is not None:
            ns, keys = old
            self._refs.subtract((ns, k) for k in keys)
            for k in keys:
                if self._refs[(ns, k)] <= 0:
                    del self._refs[(ns, k)]

    def _run_hint(self, h: Hint, ns: tuple[str, ...], own: tuple[bytes, ...], root: bytes,
                  session: str | None) -> None:
        if h.session is not None:
            ns, keys = self._chains.get(h.session, (ns, ()))
        elif h.keys is not None:
            keys = h.keys
        elif h.tokens is not None:
            keys = tuple(KeyChain(self.tokens_per_key, self.key_seed, root).extend(h.tokens))
        else:
            keys = own
        if h.action is HintAction.RELEASE:
            ending = h.session if h.session is not None else session
            held = self._chains.get(ending) if ending is not None else None
            mine = held[1] if held is not None else ()
            keys = tuple(k for k in keys if self._refs[(ns, k)] - (k in mine) <= 0)
            if h.session is not None and held is not None:
                self._drop_session(h.session)
                self._submit(_Note(held[0], h.session, (), True))
        if not keys:
            self.counters.add(hint_empty=1)
            return
        self._submit(_Job(ns, keys, h.action, h.ttl_s))

    def _submit(self, job: _Job | _Note) -> None:
        if not self._jobs.submit(job):
            self.counters.add(hint_dropped=1)
            self._log_once("dropped", "kvstore connector: the hint queue is full (%d); dropping hints",
                           self._jobs.capacity)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued hint has run and been counted; False if ``timeout_s`` passed first."""
        return self._jobs.flush(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Run what is queued (flush), then stop the thread."""
        self._jobs.close(timeout_s)

    # -- the background thread -------------------------------------------------------------------------
    def _run(self, jobs: list[_Job | _Note]) -> None:
        for job in jobs:
            if isinstance(job, _Note):
                self._send_note(job)
                continue
            try:
                self._send(job)
            except Exception:  # noqa: BLE001 - the thread must live on
                self.counters.add(hint_failed=len(job.keys) * len(job.namespaces))
                log.exception("kvstore connector: a %s hint failed", job.action.value)

    def _send_note(self, note: _Note) -> None:
        """One Client.note_session per shard namespace; each counted noted or failed. Never raises."""
        noted = failed = 0
        for ns in note.namespaces:
            try:
                c = self.link.client
                if c is not None and not callable(getattr(c, "note_session", None)):
                    self._log_once("no-note", "kvstore connector: this kvstore client has no note_session(); "
                                   "session notes are counted as session_note_failed")
                    c = None
                got = None if c is None else self.link.call(ns, _note_call(ns, note))
            except Exception:  # noqa: BLE001 - the thread must live on
                log.exception("kvstore connector: a session note failed")
                got = None
            if got is None:
                failed += 1
            else:
                noted += 1
        self.counters.add(**{k: v for k, v in (("session_noted", noted), ("session_note_failed", failed)) if v})

    def _send(self, job: _Job) -> None:
        """One Client.hint per shard namespace; one outcome counted per key and namespace."""
        outcomes: Counter[str] = Counter()
        failed = 0
        for ns in job.namespaces:
            c = self.link.client
            if c is not None and not callable(getattr(c, "hint", None)):
                self._log_once("no-hint", "kvstore connector: this kvstore client has no hint(); hints are counted "
                               "as hint_failed")
                c = None
            got = None if c is None else self.link.call(ns, _hint_call(ns, job))
            if got is None or len(got) != len(job.keys):
                failed += len(job.keys)
                continue
            outcomes.update("hint_" + HintOutcome(o).value for o in got)
        if failed:
            outcomes["hint_failed"] += failed
        self.counters.add(**outcomes)

    def _log_once(self, what: str, msg: str, *args: Any) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning(msg, *args)
        else:
            log.debug(msg, *args)
