"""The RAM tier's arena: shared memory the daemon owns and clients map, and the slots carved from it.

    layout.py     where things are inside an arena file (header, generation blocks per slab, slabs); the same
                  for the daemon's view and every tenant's file
    files.py      one arena file: an anonymous, sealed memfd of the arena's full size, sparse until used
    backing.py    the daemon's arena: one virtual range stitched slab by slab from per-tenant memory files
                  (slabs move between tenants only when empty; an epoch per slab tells GPU pins to re-pin)
    allocator.py  O(1) slot allocation: slabs carved into size classes 4 KiB * 2^k * {1, 1.25, 1.5, 1.75}
    vm.py         thin libc wrappers mmap cannot do: MAP_FIXED remaps, munmap, mlock, hole punching
    journal.py    the RAM journal: a header per committed slot (key, size, generation, xxh3) in a file only
                  the daemon holds, so a successor can serve the arena after a hand-over or a crash
    verify.py     a journal's records checked against the arena before a successor serves their blocks

The arena socket that hands these files to clients is the daemon's kvstore/server/fast_server.py; the client's
reference-counted mappings are kvstore/client/arena_map.py.
"""
