"""The closed sets every layer shares, as IntEnums: the ground floor of kvstore's vocabulary.

The wire (proto/kvstore/v1/kvstore.proto), the fast-path frames, the engine and the client all speak about
the same few closed sets: which tier holds a block and what a Reserve did with each key. They used to be
bare ints repeated in five places; now each set is defined once here, as IntEnums whose values equal the
proto's enums (tests/test_vocab.py holds them equal), so a value crosses protobuf, the binary fast path and
numpy columns unchanged (an IntEnum is an int) while code reads `Tier.RAM` instead of `1`.

This module imports nothing from kvstore: every other module may import it.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["Tier", "ReserveOutcome", "TIER_NAMES"]


class Tier(IntEnum):
    """Where a Lookup found a key (proto `Tier`)."""

    NONE = 0  # not found
    RAM = 1  # in the arena
    DISK = 2  # on the disk tier; a Lookup starts its promotion into the arena
    PEER = 3  # on a peer (a Lookup without lease only); its fetch into the arena has started


class ReserveOutcome(IntEnum):
    """What a Reserve did with one key (proto `ReserveOutcome`)."""

    RESERVED = 0  # slot given: copy the bytes to its offset, then Commit
    ALREADY_PRESENT = 1  # stored already: nothing to write
    IN_FLIGHT = 2  # another writer holds a reservation for it: nothing to write


TIER_NAMES: dict[int, str] = {int(t): t.name.lower() for t in Tier}
"""Tier value -> the lower-case name the CLI, metrics labels and JSON output use ("none", "ram", ...)."""
