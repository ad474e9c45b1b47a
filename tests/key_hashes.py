"""Counting the connector's key hashes (kvstore_connector/keys.py chains xxh3-128): shared by the key memo's tests in the
main suite and under vLLM's scheduler (tests/vllm_sched), which say how many chunks a turn hashed."""

from __future__ import annotations

import pytest
import xxhash

__all__ = ["count_key_hashes"]


def count_key_hashes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A one-item list counting xxh3-128 digests from now on (vLLM hashes its own blocks with SHA-256)."""
    count = [0]
    real = xxhash.xxh3_128_digest

    def counting(data: bytes, seed: int = 0) -> bytes:
        count[0] += 1
        return real(data, seed=seed)
    monkeypatch.setattr(xxhash, "xxh3_128_digest", counting)
    return count
