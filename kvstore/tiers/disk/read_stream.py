"""Reads as a stream: each thread verifies the block it read last while its next read is in flight.

Why: a read is verified before anything is served (reuse check, decode, xxh3 of every byte: reader.py), and a
plain read_into does that after its pread, with no read of that thread in flight meanwhile. On the promoters'
two threads the hash took 3-5 % of the read rate (2 MiB blocks, bench.disk's full passes at 2.4-2.6 GB/s: raw
O_DIRECT pread with xxh3 after each block 0.95-0.96 of the plain preads; the same with each hash during the next
pread 0.98-0.99). Splitting one block's read into chunks to hash the first while the second is read was worse
(smaller requests: 0.77-0.94), so the overlap is across blocks.

    read_stream(reader, next_item, done)

    next_item() -> R | None      the next read (anything with namespace, key, address, capacity); None ends the
                                 stream. Called on the stream's thread, between its reads.
    done(item, status, length)   exactly once per item next_item returned, after its destination holds the
                                 verified block (OK) or was scrubbed (any other status): never unverified bytes.
                                 Statuses as read_into's (reader.py). Runs during the next item's pread.

One pread in flight per calling thread at any time (the queue depth of the benchmark's limit: one request per
promoter thread); BlockIO.pread's `during` (native AIO, aio.py) runs the previous item's verification and
done() while it is in flight. When next_item has nothing more, the last block is verified at once: a stream
never holds a block back waiting for more work. Two bounce buffers per thread (reader.py) since a compressed
block may wait for its verification while the next one lands.

Exceptions: a destination too small for its block raises InvalidRequestError (as read_into does), and done()
may raise; either way every item next_item returned gets its done() (IO_ERROR for the one that raised, its
destination scrubbed) and no read is left in flight before the exception propagates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from kvstore.tiers.disk.reader import BlockReader, Opened
from kvstore.tiers.disk.types import DiskStatus

__all__ = ["ReadRequest", "read_stream"]


class ReadRequest(Protocol):
    """One block to read into `address` (page-aligned, `capacity` bytes), e.g. the engine's Promotion."""

    @property
    def namespace(self) -> str: ...
    @property
    def key(self) -> bytes: ...
    @property
    def address(self) -> int: ...
    @property
    def capacity(self) -> int: ...


R = TypeVar("R", bound=ReadRequest)


def read_stream(reader: BlockReader, next_item: Callable[[], R | None],
                done: Callable[[R, DiskStatus, int], None]) -> None:
    """See the module docstring."""
    stream = _Stream(reader, done)
    try:
        while (item := next_item()) is not None:
            stream.add(item)
    finally:
        stream.flush()


class _Stream(Generic[R]):
    """The item whose read has landed and waits for its verification, and the bounce slot the next one uses."""

    def __init__(self, reader: BlockReader, done: Callable[[R, DiskStatus, int], None]) -> None:
        self._reader, self._done = reader, done
        self._landed: tuple[R, Opened, int | OSError] | None = None
        self._slot = 0
        self._failed: BaseException | None = None

    def add(self, item: R) -> None:
        """Open and read `item`, verifying the landed one during its pread."""
        try:
            opened = self._reader.open(item.namespace, item.key, item.address, item.capacity)
        except BaseException:
            self._done(item, DiskStatus.IO_ERROR, 0)
            raise
        if opened is None:
            self._done(item, DiskStatus.NOT_FOUND, 0)
            return
        try:
            got = self._reader.land(opened, self._flush_during, self._slot)
        except BaseException:   # a bug below the pread: give the read up, the landed one is flushed by our caller
            self._reader.abandon(opened)
            self._done(item, DiskStatus.IO_ERROR, 0)
            raise
        self._landed, self._slot = (item, opened, got), self._slot ^ 1
        if self._failed is not None:   # the previous item's done() raised during this read: now this one is safe
            failed, self._failed = self._failed, None
            raise failed

    def flush(self) -> None:
        """Verify the landed item (if any) and report it."""
        landed, self._landed = self._landed, None
        if landed is not None:
            item, opened, got = landed
            status, length = self._reader.verify(opened, got)
            self._done(item, status, length)

    def _flush_during(self) -> None:
        """flush() while a read is in flight: an exception waits until that read has landed (add re-raises)."""
        try:
            self.flush()
        except BaseException as exc:
            self._failed = exc
