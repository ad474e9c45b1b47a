"""Puts into spare slots: a copy and one request (Store), instead of Reserve, copy, Commit.

The daemon grants a fast-path connection arena slots ahead of its puts (kvstore/engine/spares.py; SPARE, which
replaces the slots the connection held: it keeps slots of one size). A put of n blocks of one size takes n of
this connection's slots for that size, copies the blocks into them, and sends STORE naming them: the daemon
binds and commits the new keys in one step and grants a new slot for each one used, so the next put of that
size makes one request again. A key already present (or being written) leaves its slot spare here. Slots are
the connection's, and a connection is one thread's (fast_channel.py), so no other thread copies into them.

Everything that does not fit answers None and the caller puts the Reserve way (with its own answers and errors):
mixed sizes, more blocks than a connection may hold, the daemon granting too few slots (then not asked again
for that size for REFUSED_S), a connection found dead before the send, an arena of another daemon incarnation.
A refusal of the Store itself (unknown namespace, another tenant's) is raised as the daemon's KVStoreError, and
the slots stay spare.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

from kvstore.client.fast_channel import UNENCODABLE, FastChannel, FastConn, decoded_reply
from kvstore.errors import ConfigError
from kvstore.fastpath import protocol as fp
from kvstore.fastpath import spare_bodies as sb
from kvstore.vocab import ReserveOutcome

__all__ = ["store", "spares_wanted", "MAX_BLOCKS", "REFUSED_S"]

MAX_BLOCKS = 64     # the daemon's per-connection limit (kvstore/engine/spares.py MAX_PER_OWNER)
REFUSED_S = 1.0     # after the daemon granted too few slots for a size, the Reserve way for this long

# copy(incarnation, offsets): copy the blocks into those slots of that daemon's arena; False when this client
# has no mapping of it (the daemon restarted): nothing copied
Copy = Callable[[int, list[int]], bool]


def spares_wanted(asked: bool | None) -> bool:
    """Client(spare_slots=...), else $KVSTORE_SPARE_SLOTS (unset or 1: on, 0: off). Off: every put reserves,
    and the connection holds no arena slot outside the cache (an exact replay of an eviction policy wants that)."""
    if asked is not None:
        return asked
    raw = os.environ.get("KVSTORE_SPARE_SLOTS", "").strip()
    if raw not in ("", "0", "1"):
        raise ConfigError(f"KVSTORE_SPARE_SLOTS={raw!r}: use 1 (puts through spare slots, the default) or 0")
    return raw != "0"


def _slots(channel: FastChannel, c: FastConn, size: int, n: int) -> list[int] | None:
    """n spare slots of connection c for blocks of `size` bytes. When it holds fewer, the daemon replaces all
    of them (any size) with n new ones, or with none: then the Reserve way for REFUSED_S."""
    pool = c.spares.get(size, [])
    if len(pool) < n:
        if time.monotonic() < c.spares_refused.get(size, 0.0):
            return None
        reply = channel.call_on(c, fp.SPARE, sb.encode_spare(size, n))
        if reply is None:
            return None
        pool = decoded_reply(sb.decode_spare_reply, reply)[1]
        c.spares = {size: pool}  # what it held before is freed
        if len(pool) < n:
            c.spares_refused[size] = time.monotonic() + REFUSED_S
            return None
    taken = pool[-n:]
    del pool[-n:]
    return taken


def store(channel: FastChannel, namespace: str, keys: Sequence[bytes], sizes: Sequence[int],
          copy: Copy) -> tuple[list[int], int] | None:
    """(outcome per key, how many stored) of a put through spare slots; None: put the Reserve way."""
    n = len(keys)
    if not 0 < n <= min(MAX_BLOCKS, channel.max_batch_keys) or list(sizes).count(sizes[0]) != n:
        return None
    c = channel.conn()
    taken = _slots(channel, c, sizes[0], n)
    if taken is None:
        return None
    pool = c.spares[sizes[0]]
    try:
        body = sb.encode_store(namespace, keys, sizes, taken)
    except UNENCODABLE:
        pool.extend(taken)  # a key or namespace the fast format cannot carry: the Reserve way says what is wrong
        return None
    try:
        if not copy(c.incarnation, taken):
            pool.extend(taken)
            return None
        reply = channel.call_on(c, fp.STORE, body)
    except BaseException:
        pool.extend(taken)  # refused (or the copy failed): nothing was stored, the slots are still this conn's
        raise
    if reply is None:
        return None  # the connection was dead: its slots went with it
    stored, outcomes, refill = decoded_reply(sb.decode_store_reply, reply)
    for i, outcome in enumerate(outcomes):
        if outcome != ReserveOutcome.RESERVED:
            pool.append(taken[i])
        if refill[i]:
            pool.append(refill[i])
    return outcomes, stored
