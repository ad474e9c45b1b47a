"""A soak client process: mixed put / get / lookup with content verification, or a lease holder.

    rw      loops until the stop file appears: put_many of random keys (bytes derived from the keys), get_many
            and verify every byte, prefix lookups of a chain then a verified get of the present prefix, exists.
            A daemon that is down or restarting is retried; an unknown namespace (restart without disk copies)
            is registered again. Counters go to a JSON file every 0.5 s and at once when a wrong byte is seen,
            so a SIGKILL loses at most half a second of counts and never a wrong byte.
    holder  puts a few blocks, leases them with a Lookup, reports, then sleeps holding the leases until the
            driver SIGKILLs it: its leases must expire by TTL and their slots come back.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections import Counter

from bench.soak.values import NS, SOAK_TENANT, expected, soak_key, wrong_bytes
from kvstore import Client, KVStoreError, StoreUnavailableError, UnknownNamespaceError

__all__ = ["main"]


class Counts:
    def __init__(self, path: str) -> None:
        self.path = path
        self.ops = self.bytes_verified = self.wrong_bytes = self.hits = self.misses = 0
        self.errors: Counter[str] = Counter()
        self.holding = 0
        self._last = 0.0

    def flush(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < 0.5:
            return
        self._last = now
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"ops": self.ops, "bytes_verified": self.bytes_verified, "wrong_bytes": self.wrong_bytes,
                       "hits": self.hits, "misses": self.misses, "errors": dict(self.errors),
                       "holding": self.holding}, fh)
        os.replace(tmp, self.path)


def _verify(c: Counts, keys: list[bytes], got: list) -> None:
    for k, v in zip(keys, got):
        if v is None:
            c.misses += 1
            continue
        c.hits += 1
        bad = wrong_bytes(k, v)
        c.bytes_verified += len(v)
        if bad:
            c.wrong_bytes += bad
            c.errors["wrong_block"] += 1
            c.flush(force=True)


def _client(address: str) -> Client:
    cl = Client(address, timeout_s=3.0, token_file="")
    cl.register_namespace(NS, tenant=SOAK_TENANT)
    return cl


def run_rw(address: str, counts: Counts, stop_path: str, seed: int, keyspace: int) -> None:
    rng = random.Random(seed)
    cl: Client | None = None
    while not os.path.exists(stop_path):
        try:
            if cl is None:
                cl = _client(address)
            op = rng.random()
            keys = [soak_key(rng.randrange(keyspace)) for _ in range(rng.randint(1, 8))]
            keys = list(dict.fromkeys(keys))
            if op < 0.40:
                cl.put_many(NS, keys, [expected(k) for k in keys])
            elif op < 0.75:
                _verify(counts, keys, cl.get_many(NS, keys))
            elif op < 0.90:
                start = rng.randrange(max(1, keyspace - 16))
                chain = [soak_key(i) for i in range(start, start + 16)]
                n = cl.lookup_prefix(NS, chain)
                if n:
                    _verify(counts, chain[:n], cl.get_many(NS, chain[:n]))
            else:
                cl.exists(NS, keys)
            counts.ops += 1
        except UnknownNamespaceError:
            counts.errors["UnknownNamespaceError"] += 1
            if cl is not None:
                cl.close()
            cl = None
        except StoreUnavailableError:
            counts.errors["StoreUnavailableError"] += 1
            if cl is not None:
                cl.close()
            cl = None
            time.sleep(0.1)
        except KVStoreError as exc:
            counts.errors[type(exc).__name__] += 1
        counts.flush()
    if cl is not None:
        cl.close()


def run_holder(address: str, counts: Counts, seed: int) -> None:
    rng = random.Random(seed)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with _client(address) as cl:
                keys = [soak_key(1_000_000 + rng.randrange(1000)) for _ in range(4)]
                keys = list(dict.fromkeys(keys))
                cl.put_many(NS, keys, [expected(k) for k in keys])
                lease = cl.lookup(NS, keys, lease=True)
                counts.holding = len(lease.offsets) if lease.id else 0
                counts.flush(force=True)
                time.sleep(120)  # hold the leases until the driver's SIGKILL
        except KVStoreError as exc:
            counts.errors[type(exc).__name__] += 1
            counts.flush(force=True)
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak.worker")
    p.add_argument("--role", choices=("rw", "holder"), required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--stats", required=True)
    p.add_argument("--stop", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keyspace", type=int, default=3000)
    a = p.parse_args(argv)
    counts = Counts(a.stats)
    counts.flush(force=True)
    try:
        if a.role == "rw":
            run_rw(a.address, counts, a.stop, a.seed, a.keyspace)
        else:
            run_holder(a.address, counts, a.seed)
    finally:
        counts.flush(force=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
