"""The daemon's arena: one virtual range stitched slab by slab from per-domain memory files.

A *domain* is who may map a slab's bytes. Without tokens there is one domain ("", everyone on the node is one
trust domain, as with a plain shared arena). With tokens every tenant is a domain with its own file
(files.py), and a client is handed only its own tenant's file (kvstore/server/fast_server.py). So a tenant cannot read or write
another tenant's blocks through shared memory: they are not in any memory it can map.

Memory still flows between tenants, a slab at a time, under the node-wide capacity and the quota rules the
engine already has. The allocator decides (allocator.py: an empty slab goes to whoever needs one); this class
makes it so (`bind`), under the engine's lock:

    1. allocate the slab's generation block and data pages in the new domain's file (kernel-zeroed pages:
       nothing of the previous owner can be in them),
    2. MAP_FIXED them over the slab's place in the daemon's range (so every daemon-side reader and writer
       -- disk tier, peer tier, streams -- keeps using one base address plus an offset, unchanged),
    3. carry the generations over (+1) and bump the epochs of both files (layout.py says why),
    4. punch the slab out of the old file, which gives its memory back.

The daemon's range starts out mapped from the "" file, created pre-faulted and mlock'ed at full size exactly
like the old single arena; with tokens that memory moves out slab by slab as tenants claim slabs. A bind costs
one first-touch of a slab (~1-2 GB/s here: a few ms for 16 MiB) and happens only when a slab changes domain:
an empty slab stays bound to its domain and is reused by it first.

Every file and every bind is also written to the RAM journal (journal.py: domain names, which domain backs
each slab), so a successor handed these files (a hand-over restart, systemd's fd store) can stitch the same
view again: `adopt` maps each slab from the file the journal names, without allocating or copying a page.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from collections.abc import Callable

from kvstore.arena import vm
from kvstore.arena.files import ArenaFile
from kvstore.arena.journal import RamJournal
from kvstore.arena.layout import ArenaLayout
from kvstore.errors import ConfigError

__all__ = ["ArenaBacking", "SHARED_DOMAIN"]

log = logging.getLogger(__name__)

SHARED_DOMAIN = ""


class ArenaBacking:
    def __init__(self, layout: ArenaLayout, *, isolated: bool = False, lock: str = "auto") -> None:
        if lock not in ("auto", "on", "off"):
            raise ConfigError(f"arena lock mode {lock!r} must be one of auto, on, off")
        self.layout = layout
        self.isolated = isolated
        self._lock_mode = lock
        self._files_lock = threading.Lock()  # the fast-path socket creates files; the engine binds slabs
        pool = ArenaFile(layout.name, layout.size_bytes)
        self._files: dict[str, ArenaFile] = {SHARED_DOMAIN: pool}
        self.on_new_file: list[Callable[[str, ArenaFile], None]] = []  # systemd's fd store keeps each new file
        try:
            self.journal = RamJournal.create(layout)
        except BaseException:
            pool.close()
            raise
        self._domain_index = {SHARED_DOMAIN: 0}
        try:
            pool.reserve(0, layout.size_bytes)
            self.address = vm.mmap(0, layout.size_bytes, vm.MAP_SHARED | vm.MAP_POPULATE, pool.fd, 0)
        except BaseException:
            pool.close()
            self.journal.close()
            raise
        self.prefaulted = True
        self._finish(lock)

    def _finish(self, lock: str) -> None:
        """Lock the whole range as configured and make the views (after the range is mapped)."""
        layout = self.layout
        self.locked = False
        if lock != "off":
            self.locked = self._mlock_all(required=(lock == "on"))
        self.view = vm.byte_view(self.address, layout.size_bytes)
        self.generations = vm.u64_view(self.address + layout.gen_table_offset, layout.gen_table_bytes // 8)
        self.binds = 0  # slabs moved between domains since start

    @classmethod
    def adopt(cls, layout: ArenaLayout, files: dict[str, ArenaFile], journal: RamJournal, *, isolated: bool,
              lock: str = "auto") -> tuple[ArenaBacking, list[int]]:
        """The arena of a previous daemon, from its files (by domain) and journal: the range stitched again slab
        by slab as the journal says, no page allocated or copied. Returns it and the slabs whose file is gone
        (their blocks cannot be served; the slab is mapped from the shared file and starts empty). The files
        and the journal are owned from now on."""
        if lock not in ("auto", "on", "off"):
            raise ConfigError(f"arena lock mode {lock!r} must be one of auto, on, off")
        self = cls.__new__(cls)
        self.layout, self.isolated, self._lock_mode = layout, isolated, lock
        self._files_lock = threading.Lock()
        self._files = dict(files)
        self.on_new_file = []
        self.journal = journal
        names = journal.domains()
        self._domain_index = {name: i for i, name in names.items()}
        self.address = vm.mmap(0, layout.size_bytes, vm.MAP_SHARED, files[SHARED_DOMAIN].fd, 0)
        lost: list[int] = []
        for slab, idx in enumerate(journal.slab_domains().tolist()):
            name = names.get(idx, None) if idx > 0 else SHARED_DOMAIN
            f = files.get(name) if name is not None else None
            if f is None:
                lost.append(slab)
                journal.set_slab_domain(slab, 0)
                continue
            if name != SHARED_DOMAIN:
                g_off, g_len = layout.slab_gen_range(slab)
                d_off, d_len = layout.slab_data_range(slab)
                vm.mmap(self.address + g_off, g_len, vm.MAP_SHARED | vm.MAP_FIXED, f.fd, g_off)
                vm.mmap(self.address + d_off, d_len, vm.MAP_SHARED | vm.MAP_FIXED, f.fd, d_off)
        self.prefaulted = False  # resident already: its pages were the previous daemon's
        self._finish(lock)
        return self, lost

    def files(self) -> dict[str, ArenaFile]:
        """Every domain's file (the hand-over sends them all)."""
        with self._files_lock:
            return dict(self._files)

    def domain_index(self, domain: str) -> int:
        """The domain's index in the journal (0: the shared file); systemd's fd store names files by it."""
        with self._files_lock:
            return self._domain_index[domain]

    def domain_of_slab(self, slab: int) -> str:
        """The domain whose file backs `slab` now, as the journal records it."""
        idx = int(self.journal.slab_domains()[slab])
        if idx <= 0:
            return SHARED_DOMAIN
        for name, i in self._domain_index.items():
            if i == idx:
                return name
        return SHARED_DOMAIN

    def _mlock_all(self, required: bool) -> bool:
        size = self.layout.size_bytes
        if vm.mlock(self.address, size):
            return True
        err = vm.last_error()
        msg = (f"mlock of the {size} byte arena failed ({err}): raise RLIMIT_MEMLOCK (ulimit -l / "
               "LimitMEMLOCK=infinity) or run with CAP_IPC_LOCK")
        if required:
            self.destroy()
            raise ConfigError(msg + "; or set arena_lock = 'auto' to run unlocked")
        log.warning("%s; running with an unlocked arena", msg)
        return False

    # -- files ------------------------------------------------------------------------------------------
    def file_of(self, domain: str) -> ArenaFile:
        """The domain's file, created (sparse, sealed) on first use."""
        with self._files_lock:
            f = self._files.get(domain)
            if f is not None:
                return f
            f = ArenaFile(f"{self.layout.name}-tenant-{domain}", self.layout.size_bytes)
            try:  # the generation table is small and read by lookups: give it pages now
                f.reserve(self.layout.gen_table_offset, self.layout.gen_table_bytes)
            except BaseException:
                f.close()
                raise
            self._files[domain] = f
            if domain not in self._domain_index:
                self._domain_index[domain] = len(self._domain_index)
                self.journal.set_domain(self._domain_index[domain], domain)
        for hook in self.on_new_file:
            hook(domain, f)
        return f

    def domains(self) -> dict[str, int]:
        """Resident bytes of each domain's file (what each holds in memory right now)."""
        with self._files_lock:
            return {d: f.resident_bytes for d, f in self._files.items()}

    # -- slabs ------------------------------------------------------------------------------------------
    def bind(self, slab: int, old: str, new: str) -> None:
        """Move an empty slab from domain `old`'s file to `new`'s (module docstring). Under the engine's lock;
        OSError or ConfigError when the memory cannot be had (the slab then stays with `old`)."""
        if old == new:
            return
        lay = self.layout
        f_old, f_new = self.file_of(old), self.file_of(new)
        g_off, g_len = lay.slab_gen_range(slab)
        d_off, d_len = lay.slab_data_range(slab)
        e = lay.epoch_index(slab)
        block = self.generations[e: e + lay.gen_stride].copy()
        f_new.reserve(g_off, g_len)
        f_new.reserve(d_off, d_len)
        try:
            self._map(f_new, g_off, g_len)
            self._map(f_new, d_off, d_len)
        except OSError:
            self._map(f_old, g_off, g_len)  # put the old pages back where they were
            self._map(f_old, d_off, d_len)
            f_new.punch(d_off, d_len)
            raise
        mine = self.generations[e: e + lay.gen_stride]
        new_epoch = int(mine[0]) + 1
        np.add(block[1:], np.uint64(1), out=mine[1:])  # every copy of the old owner's slots is now stale
        mine[0] = new_epoch
        f_old.write_u64(g_off, int(block[0]) + 1)      # the old file's registrations of this slab are stale
        f_old.punch(d_off, d_len)
        self.journal.set_slab_domain(slab, self._domain_index[new])
        self.binds += 1

    def _map(self, f: ArenaFile, offset: int, length: int) -> None:
        vm.mmap(self.address + offset, length, vm.MAP_SHARED | vm.MAP_FIXED | vm.MAP_POPULATE, f.fd, offset)
        if self.locked and not vm.mlock(self.address + offset, length):
            log.warning("mlock of a rebound arena slab failed: the arena is no longer fully locked")
            self.locked = False

    def destroy(self, unmap: bool = False) -> None:
        """Close the files (their memory goes when the last client mapping goes). `unmap` also drops the
        daemon's own mapping: only when no thread can touch `view` any more (tests; the daemon exits instead)."""
        with self._files_lock:
            files, self._files = list(self._files.values()), {}
        for f in files:
            f.close()
        self.journal.close()
        if unmap and self.address:
            if self.locked:
                vm.munlock(self.address, self.layout.size_bytes)
            self.view = None  # type: ignore[assignment]  # unmapped: a later use fails loudly
            self.generations = None  # type: ignore[assignment]  # unmapped: a later use fails loudly
            vm.munmap(self.address, self.layout.size_bytes)
            self.address = 0
