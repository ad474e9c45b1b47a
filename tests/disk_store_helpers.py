"""Shared shapes and helpers of the DiskStore tests (tests/test_disk_store*.py): page-aligned buffers, data
generators, the small store configuration, one-batch write and read, and the `store` fixture.

Why a module: the DiskStore tests are split by concern (round trips, reclamation, faults, races) and all drive
the store the same way; segments are 1 MiB (the smallest allowed), capacity 3 segments, sync off.
"""

from __future__ import annotations

import os

import logging
import mmap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.tiers.disk import DiskConfig, DiskStatus, DiskStore, WriteItem

__all__ = ["KiB", "MiB", "PAGE", "OK", "NOT_FOUND", "LOGGER", "Buf", "random_bytes", "bf16_like", "cfg",
           "store_fixture", "write", "read", "disk_errors"]

KiB = 1024
MiB = 1024 * KiB
PAGE = 4096
OK, NOT_FOUND = DiskStatus.OK, DiskStatus.NOT_FOUND
LOGGER = "kvstore.tiers.disk"


class Buf:
    """Page-aligned memory (an anonymous mmap, as an arena slot) with a numpy view and its raw address."""

    def __init__(self, size: int) -> None:
        self.size = -(-size // PAGE) * PAGE
        self.mm = mmap.mmap(-1, self.size)
        self.arr = np.frombuffer(self.mm, dtype=np.uint8)
        self.address = self.arr.ctypes.data
        assert self.address % PAGE == 0

    def put(self, data: bytes, at: int = 0) -> int:
        self.arr[at:at + len(data)] = np.frombuffer(data, dtype=np.uint8)
        return self.address + at

    def get(self, n: int, at: int = 0) -> bytes:
        return self.arr[at:at + n].tobytes()


def random_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(n)


def bf16_like(n: int, seed: int) -> bytes:
    """bf16 KV-like data: the high halves of normal float32s (repetitive high bytes, noisy low bytes)."""
    f = np.random.default_rng(seed).standard_normal(-(-n // 2), dtype=np.float32)
    return (f.view(np.uint32) >> 16).astype(np.uint16).tobytes()[:n]


def cfg(directory: Path, **kw: object) -> DiskConfig:
    opts: dict = {"capacity_bytes": 3 * MiB, "segment_bytes": 1 * MiB, "sync": "none"}
    opts.update(kw)
    return DiskConfig(str(directory), **opts)


def store_fixture() -> Callable[..., Any]:
    """`store = store_fixture()` in a test module: an open DiskStore of cfg() in tmp_path, closed after the test."""

    @pytest.fixture
    def store(tmp_path: Path) -> Iterator[DiskStore]:
        s = DiskStore(cfg(tmp_path / "disk"))
        s.open()
        yield s
        s.close()
    return store


def write(
    store: DiskStore, buf: Buf, ns: str, blocks: dict[bytes, bytes], codec: str | None = None
) -> list[DiskStatus]:
    """One batch: every block copied into `buf` back to back (page-aligned), then write_many."""
    items, at = [], 0
    for key, data in blocks.items():
        items.append(WriteItem(ns, key, buf.put(data, at), len(data), codec))
        at += -(-len(data) // PAGE) * PAGE
    return store.write_many(items)


def read(store: DiskStore, ns: str, key: bytes, size: int = 2 * MiB) -> tuple[DiskStatus, bytes]:
    out = Buf(size)
    out.arr[:] = 0xAB
    status, n = store.read_into(ns, key, out.address, out.size)
    return status, out.get(n)


def disk_errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith(LOGGER) and r.levelno >= logging.ERROR]


def flip_byte(path: str, offset: int, mask: int) -> None:
    """Damage one byte of a segment file in place (XOR `mask`), synced: what a bad sector would read back as."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ mask]))
        f.flush()
        os.fsync(f.fileno())
