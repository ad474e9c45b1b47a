"""Partial last blocks ("tails"): stored when a request finishes, offered to a request that continues them.

Why: a hit is otherwise whole stored blocks, so an agent's next turn recomputes the previous turn's partial last
block (up to block_size - 1 tokens, each attending to the whole context) before its own new tokens. vLLM's own
prefix cache recomputes it too; a store that keeps it makes the turn cheaper than a GPU that never evicts.

Save: the tokens whose KV a request computed past its last full block, once final (its prompt's with save
"prompt"; every token but the last sampled one with "all"), are its tail. Its block is gathered whole under the
tail key (kvstore_connector/keys.py: the last full key plus the tail's own tokens), so the slot is a stored block like
any other. The save rides in the step whose forward writes the last of that KV where the scheduler knows which
step that is: the one computing the prompt's last token ("prompt"), or the one sampling token max_tokens
("all"; agents' turns as bench.serve sends them). A request that stops sooner (EOS, a stop string) is known to
be done only after its last forward: the scheduler then asks vLLM to keep its blocks (request_finished -> True)
and the worker reports the request sent once it has gathered the block, in the next step; vLLM frees them then.
Every such request is reported, whatever the save's fate (a store that is down too): a request never reported
would hold its blocks forever. (vLLM's server steps the engine while such a request waits; its offline LLM in
one process does not step after generate returns, so there the blocks are freed by the next generate's first
step, and reset_prefix_cache fails until then.)

Lookup: after the prompt's hit keys (n >= 1 of them), the partial block that may continue them: an agent's next
turn holds the previous turn's whole context, which ended inside block n, and then its new tokens. The lookup cannot
know where that context ended, so it asks which tail keys of every length 1 .. block_size - 1 exist (fewer where
the prompt ends sooner; and the block's full key where the prompt fills it: ~20 us of hashing for 63 lengths, one
Exists round trip, which the daemon does not count as a lookup), then probes the longest in every shard (one more
pipelined round trip, counted as the one key it is). The hit covers that tail up to the prompt's last token, which
vLLM computes itself; so a resent prompt hits all but that one token.

Load: the tail's block is one more key of the request's load, copied whole into the block vLLM allocated for
those tokens; positions past the tail are overwritten by vLLM's forward before anything reads them (attention
reads positions below the sequence length only). A failed tail load is a failed block: vLLM recomputes it. The
load may be synchronous or asynchronous (vLLM 0.32 and 0.33 take an asynchronous hit that ends inside a block as
it is); with load_mode "auto" a tail on disk counts toward sync_fetch_bytes like any block. The Exists is
cluster-wide: lengths this node's daemon lacks are asked of their owners on the peer tier (one metadata-only
probe per peer, in parallel), so a tail another node saved is found, and the probe that follows starts its
fetch like any peer hit.

Where: one stored block per vLLM block (blocks_per_key 1: the default wherever a vLLM block reaches 0.5 MiB)
and one KV cache group (no hybrid model); elsewhere tails are off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore_connector.keys import tail_keys
from kvstore_connector.link import StoreLink
from kvstore.vocab import Tier

if TYPE_CHECKING:
    from kvstore.client import Client

__all__ = ["Tail", "find_tail", "finished_tail"]


@dataclass(frozen=True)
class Tail:
    """A partial block after ``full`` full keys: its first ``tokens`` tokens, stored under ``key`` (found in
    ``tier``, the farthest shard's, a Tier value)."""

    full: int
    tokens: int
    key: bytes
    tier: int = int(Tier.RAM)


def find_tail(link: StoreLink, namespaces: list[str], parent: bytes, tokens: Sequence[int], full: int, usable: int,
              seed: int, *, whole: bytes | None = None) -> Tail | None:
    """The longest stored tail of ``tokens`` (the prompt's tokens after its ``full`` hit keys, fewer than a block)
    that every shard in ``namespaces`` holds (its tier: the farthest shard's), offered up to ``usable``
    tokens (vLLM computes the prompt's last token itself); or None. ``whole``: the full key of the block those
    tokens start, where the prompt fills that block (a resent prompt then hits all but its last token, as a
    longer tail would: the loaded block's last position is recomputed)."""
    if not tokens or usable < 1 or link.client is None:
        return None
    keys = tail_keys(parent, tokens, seed) + ([whole] if whole is not None else [])

    def probe(c: Client) -> Tail | None:
        # Exists first: it neither counts as a lookup nor starts a promotion, so the daemon's lookup and hit
        # counters (its hit rate) see one key per tail found, not every length asked for
        present = c.exists(namespaces[0], keys, cluster=True)
        t = max((i + 1 for i, p in enumerate(present) if p), default=0)  # keys[t - 1] names the first t tokens
        if not t:
            return None
        tiers = [shard[0] for shard in c.probe_tiers_many(namespaces, [keys[t - 1]])]
        if all(x != Tier.NONE for x in tiers):
            return Tail(full, min(t, usable), keys[t - 1], max(int(x) for x in tiers))
        return None
    return link.call(namespaces, probe)


def finished_tail(parent: bytes, tokens: Sequence[int], computed: int, tokens_per_key: int, stored_keys: int,
                  seed: int) -> Tail | None:
    """The tail a finished request can store: the tokens of ``tokens`` (those it saves) whose KV it computed
    (``computed`` of them) past its last full key, when every full key before them is stored (``stored_keys``)
    and there are any."""
    computed = min(computed, len(tokens))
    full, t = divmod(computed, tokens_per_key)
    if not t or stored_keys < full:
        return None
    start = full * tokens_per_key
    return Tail(full, t, tail_keys(parent, tokens[start:computed], seed)[-1])
