"""The reservation table: open write reservations, their TTL, the quarantine, and how recent ones ended.

A reservation holds RESERVED entries (invisible, never evicted) until commit or abort. One that outlives its
TTL is expired: its slots go to a quarantine for `quarantine_s` before reuse, so a slow writer that still
copies into them cannot scribble over a new owner's block. The table remembers how the last few thousand
reservations ended, so a late commit is told "already committed / aborted / expired" rather than "unknown".

Also plans a Reserve (`plan`): which keys need a slot. Called under the engine's lock.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import NoReturn

from kvstore.engine.catalog import Catalog, EntryState, Namespace
from kvstore.engine.config import EngineConfig
from kvstore.engine.counters import Counters
from kvstore.engine.ttl import TtlTable
from kvstore.errors import InvalidRequestError, ReservationClosedError, UnknownReservationError
from kvstore.vocab import ReserveOutcome

__all__ = ["ReservationTable", "plan"]

_COMMITTED = int(EntryState.COMMITTED)
_QUARANTINED = int(EntryState.QUARANTINED)
_RECENT_CLOSED = 8192
_RESERVED, _PRESENT, _IN_FLIGHT = ReserveOutcome.RESERVED, ReserveOutcome.ALREADY_PRESENT, ReserveOutcome.IN_FLIGHT


def plan(cat: Catalog, ns: Namespace, keys: Sequence[bytes]) -> tuple[list[int], list[int], set[int]]:
    """(outcome per key, indexes of the keys that need a slot, entries found present) for a Reserve, from RAM.

    The present entries must not be evicted to make room: that would make their ALREADY_PRESENT a lie."""
    outcomes: list[int] = [_RESERVED] * len(keys)  # ReserveOutcome values; ReserveResult holds them as ints
    known = list(map(ns.index.get, keys))
    if known.count(None) == len(keys):  # the common case: every key is new
        return outcomes, list(range(len(keys))), set()
    todo: list[int] = []
    keep: set[int] = set()
    for i, eid in enumerate(known):
        if eid is None:
            todo.append(i)
        elif cat.state[eid] == _COMMITTED:
            outcomes[i] = _PRESENT
            keep.add(eid)
        else:
            outcomes[i] = _IN_FLIGHT
    return outcomes, todo, keep


class ReservationTable:
    """Reservation id -> (namespace, entry ids), TTL-bounded; the quarantine; the closed history.
    Called under the engine's lock."""

    def __init__(self, cat: Catalog, config: EngineConfig, free: Callable[[int], None], counters: Counters) -> None:
        self._cat = cat
        self._config = config
        self._table: TtlTable[tuple[Namespace, list[int]]] = TtlTable(config.reservation_ttl_s)
        self._closed: OrderedDict[int, str] = OrderedDict()  # recently ended reservations -> how
        self._quarantine: deque[tuple[float, int]] = deque()
        self._free = free  # RamSpace.free
        self._counters = counters
        self.expires_in_ms = int(config.reservation_ttl_s * 1000)

    def add(self, ns: Namespace, eids: list[int]) -> int:
        return self._table.add((ns, eids))

    def take(self, reservation_id: int, n_checksums: int) -> tuple[Namespace, list[int]]:
        """End a reservation by commit: its (namespace, entries). The reservation stays open when the checksum
        count is wrong (InvalidRequestError), so a corrected commit can follow."""
        payload = self._table.get(reservation_id)
        if payload is None:
            self._raise_closed(reservation_id)
        _, eids = payload
        if n_checksums and n_checksums != len(eids):
            raise InvalidRequestError(
                f"{n_checksums} checksums for a reservation of {len(eids)} blocks: send none or one each"
            )
        self._table.pop(reservation_id)
        self._close(reservation_id, "committed")
        return payload

    def abort(self, reservation_id: int) -> int:
        """End a reservation by abort: its slots are freed at once (the writer said it stopped)."""
        payload = self._table.pop(reservation_id)
        if payload is None:
            self._raise_closed(reservation_id)
        self._close(reservation_id, "aborted")
        _, eids = payload
        for eid in eids:
            self._cat.unindex(eid)
            self._free(eid)
        self._counters.aborted_blocks += len(eids)
        return len(eids)

    def expire(self, now: float) -> None:
        """Expire reservations past their TTL into the quarantine; free quarantined slots past their grace."""
        cat, counters = self._cat, self._counters
        for rid, (_, eids) in self._table.expire(now):
            self._close(rid, "expired")
            counters.reservation_expirations += len(eids)
            for eid in eids:
                cat.unindex(eid)
                cat.state[eid] = _QUARANTINED
                self._quarantine.append((now + self._config.quarantine_s, eid))
        while self._quarantine and self._quarantine[0][0] <= now:
            _, eid = self._quarantine.popleft()
            self._free(eid)
            counters.quarantine_freed += 1

    def live(self, now: float) -> list[tuple[int, tuple[Namespace, list[int]], float]]:
        """(reservation id, (namespace, entry ids), seconds left) of every open reservation."""
        return self._table.live(now)

    def quarantined(self, now: float) -> list[tuple[int, float]]:
        """(entry id, seconds until its slot is freed) of every quarantined entry."""
        return [(eid, max(0.0, at - now)) for at, eid in self._quarantine]

    @property
    def next_id(self) -> int:
        return self._table.next_id

    def restore(self, reservation_id: int, ns: Namespace, eids: list[int], seconds_left: float,
                next_id: int = 0) -> None:
        """A previous daemon's open reservation of RESERVED entries already placed here (same id, deadline)."""
        self._table.restore(reservation_id, (ns, eids), seconds_left, next_id)

    def continue_ids(self, next_id: int) -> None:
        self._table.next_id = next_id

    def held_ids(self) -> set[int]:
        """Every entry an open reservation holds (O(reserved entries))."""
        return {e for _, eids in self._table.values() for e in eids}

    def namespace_of(self, reservation_id: int) -> str | None:
        payload = self._table.get(reservation_id)
        return None if payload is None else payload[0].name

    def __len__(self) -> int:
        return len(self._table)

    def _close(self, reservation_id: int, how: str) -> None:
        self._closed[reservation_id] = how
        if len(self._closed) > _RECENT_CLOSED:
            self._closed.popitem(last=False)

    def _raise_closed(self, reservation_id: int) -> NoReturn:
        how = self._closed.get(reservation_id)
        if how is None:
            raise UnknownReservationError(
                f"reservation {reservation_id} is unknown to this daemon (never issued, or issued before a restart)"
            )
        hint = f" (reservation_ttl_s is {self._config.reservation_ttl_s:g}s; commit sooner or raise it)"
        raise ReservationClosedError(
            f"reservation {reservation_id} was already {how}" + (hint if how == "expired" else "")
        )
