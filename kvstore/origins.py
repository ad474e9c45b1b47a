"""A block's vLLM identity: what vLLM's own KV events would say of the tokens one kvstore key stores.

kvstore keys are its own chained hashes (kvstore_connector/keys.py: stable across processes); a router that
indexes vLLM's KV events knows blocks by vLLM's block hashes instead (sha256 over the parent hash, the block's
tokens and its extra keys). The vLLM connector knows both for every block it saves and hands the daemon the
vLLM side with the put (Client.annotate, before the Store or Commit of the same keys), so the daemon's
vLLM-format events (kvstore/server/kv_events) name blocks as vLLM would. One kvstore key may store several vLLM
blocks (the connector's blocks_per_key): `block_hashes` holds one hash per vLLM block, in order.

Shared by the client (early checks) and the daemon (authoritative): `check_origins` raises InvalidRequestError
naming the key and the limit.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import InvalidRequestError
from kvstore.validation import MAX_KEY_BYTES, MAX_TOKENS_PER_BLOCK, check_label

__all__ = ["BlockOrigin", "MAX_ORIGIN_HASHES", "MAX_HASH_BYTES", "MAX_ORIGIN_TOKENS", "check_origins"]

MAX_ORIGIN_HASHES = 256    # vLLM blocks per kvstore key (the connector caps blocks_per_key at 16 by default)
MAX_HASH_BYTES = MAX_KEY_BYTES  # vLLM's sha256 hashes are 32 bytes; its 64-bit int form is not sent
MAX_ORIGIN_TOKENS = 1 << 16  # tokens of one key
_MAX_TOKEN = (1 << 63) - 1


@dataclass(frozen=True, eq=True)
class BlockOrigin:
    """One key's vLLM identity. `token_ids` is an int64 array (8 bytes a token: the daemon keeps it while the
    block is stored); empty when unknown. `block_size` is vLLM's (tokens per hash), `lora_name` None without a
    LoRA adapter."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: array
    block_size: int
    lora_name: str | None = None

    @staticmethod
    def of(block_hashes: Sequence[bytes], parent_block_hash: bytes | None, token_ids: Sequence[int],
           block_size: int, lora_name: str | None = None) -> BlockOrigin:
        return BlockOrigin(tuple(block_hashes), parent_block_hash or None, array("q", token_ids), block_size,
                           lora_name or None)


def check_origins(keys: Sequence[bytes], origins: Sequence[BlockOrigin]) -> None:
    """One origin per key, each within the limits above; InvalidRequestError says which key and why."""
    if len(origins) != len(keys):
        raise InvalidRequestError(f"{len(origins)} origins for {len(keys)} keys: send one origin per key")
    for i, o in enumerate(origins):
        where = f"origin of key {i}"
        if not 1 <= len(o.block_hashes) <= MAX_ORIGIN_HASHES:
            raise InvalidRequestError(f"{where}: {len(o.block_hashes)} block hashes; send 1..{MAX_ORIGIN_HASHES} "
                                      "(one per vLLM block the key stores)")
        for h in (*o.block_hashes, *((o.parent_block_hash,) if o.parent_block_hash else ())):
            if not 1 <= len(h) <= MAX_HASH_BYTES:
                raise InvalidRequestError(f"{where}: a block hash of {len(h)} bytes; a hash is 1..{MAX_HASH_BYTES} "
                                          "bytes (vLLM's sha256 hashes are 32)")
        if not 1 <= o.block_size <= MAX_TOKENS_PER_BLOCK:
            raise InvalidRequestError(f"{where}: block_size={o.block_size}; use 1..{MAX_TOKENS_PER_BLOCK} "
                                      "(vLLM's block size: tokens per block hash)")
        n = len(o.token_ids)
        if n and n != len(o.block_hashes) * o.block_size:
            raise InvalidRequestError(f"{where}: {n} token ids for {len(o.block_hashes)} blocks of {o.block_size}: "
                                      "send every token of the key's blocks, or none")
        if n > MAX_ORIGIN_TOKENS or (n and (min(o.token_ids) < 0 or max(o.token_ids) > _MAX_TOKEN)):
            raise InvalidRequestError(f"{where}: token ids must be 0..2^63-1, at most {MAX_ORIGIN_TOKENS} a key")
        check_label("lora_name", o.lora_name or "")
