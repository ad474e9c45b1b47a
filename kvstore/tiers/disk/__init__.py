"""The disk tier: whole KV blocks in log-structured segment files (O_DIRECT), an lmdb index, xxh3 on every block.

One concern per module (tests/test_config_layout.py holds this list equal to the files):

    config.py     DiskConfig and the disk settings' rules (the only place they are checked)
    types.py      DiskStatus (the closed outcome set), WriteItem, WriteResult, DiskRecord, DiskStats, RecoveryReport
    io.py         BlockIO (O_DIRECT, buffered fallback) and FaultyIO (fault injection for tests)
    aio.py        one write in flight while its thread hashes the block (Linux native AIO via ctypes)
    codec.py      the codec registry (CODECS: none / zstd / zstd-shuffle2), encode and decode
    directory.py  the store's directory: created 0700, locked against a second daemon, wiped, probed
    segments.py   segment files and the log's space accounting (write pointer, FIFO reclamation order)
    index.py      the lmdb index (metadata only, fixed structs)
    state.py      the parts an open store shares, and the lock order
    counters.py   the store's named monotonic counters
    recovery.py   open()-time validation and rebuild
    writer.py     the write_many batch path
    reclaim.py    reclaiming the oldest segment, with a second chance for records that were read, or a cleaned one
    cleaning.py   which younger segment to clean instead: one RAM backs so much of that only a third needs copying
    floors.py     TenantFloors: per-tenant disk quotas kept at reclamation
    reader.py     the read_into path
    read_stream.py  reads as a stream: a block verified while the next one is read (the promoters')
    health.py     degraded state and its log lines
    store.py      DiskStore, the facade the engine drives

    store = DiskStore(DiskConfig(directory="/var/cache/kvstore", capacity_bytes=64 << 30))
    report = store.open()
    store.write_many([WriteItem("ns", b"key", slot_address, length)])
    status, length = store.read_into("ns", b"key", other_slot_address, slot_capacity)
"""

from kvstore.tiers.disk.config import DISK_CODECS, DiskConfig
from kvstore.tiers.disk.floors import TenantFloors
from kvstore.tiers.disk.io import AlignedBuffer, BlockIO, FaultyIO
from kvstore.tiers.disk.store import DiskStore
from kvstore.tiers.disk.types import DiskRecord, DiskStats, DiskStatus, RecoveryReport, WriteItem, WriteResult

__all__ = [
    "TenantFloors",
    "DiskConfig",
    "DISK_CODECS",
    "DiskStore",
    "DiskStatus",
    "DiskRecord",
    "DiskStats",
    "RecoveryReport",
    "WriteItem",
    "WriteResult",
    "BlockIO",
    "FaultyIO",
    "AlignedBuffer",
]
