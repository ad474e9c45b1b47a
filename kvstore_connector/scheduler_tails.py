"""The scheduler side's partial last blocks (a mixin of SchedulerSide; what tails are: kvstore_connector/tails.py): the
lookup of a tail after a prompt's hit keys, and the save of a request's final tail, in its last step where that
step is known, else after it finishes (vLLM then holds its blocks until the worker's report)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvstore_connector.config import ConnectorConfig
from kvstore_connector.link import StoreLink
from kvstore_connector.plan import SaveJob
from kvstore_connector.request_state import ReqState
from kvstore_connector.stats import ConnectorCounters
from kvstore_connector.tails import Tail, find_tail, finished_tail
from kvstore.vocab import Tier

__all__ = ["SchedulerTails"]


class SchedulerTails:
    config: ConnectorConfig
    link: StoreLink
    counters: ConnectorCounters
    tokens_per_key: int
    tails: bool                  # partial last blocks are on (kvstore_connector/tails.py: where they can load)
    _tail_saves: list[SaveJob]   # the saves of finished requests' tails, for the next step's plan

    if TYPE_CHECKING:  # SchedulerSide's own method this mixin calls: declared for the type checker only
        def _extend(self, st: ReqState, tokens: Sequence[int]) -> list[bytes]: ...
        def _names(self, st: ReqState) -> list[str]: ...

    def _find_tail(self, st: ReqState, prompt: Sequence[int], full: int) -> Tail | None:
        """The longest stored partial block after the prompt's ``full`` hit keys (an agent's next turn: the
        previous turn's context ended inside the block its new tokens fill). Off RAM it is one more block to
        read or fetch (load_mode "auto" weighs it against sync_fetch_bytes with the rest). Not asked after no hit
        at all (the caller): such a tail would be a whole context of less than a block, cheap to recompute, while
        the question costs a new prompt that hits nothing ~0.1-0.6 ms (the no-reuse case bench.serve measures).
        (The question goes to this node's daemon: a tail only a peer holds is not found.)"""
        if not self.tails:
            return None
        t, chain = self.tokens_per_key, st.chain.keys
        start = full * t
        fills = full == (len(prompt) - 1) // t and len(chain) > full  # the prompt fills the block after the hit
        whole = chain[full] if fills else None
        tail = find_tail(self.link, self._names(st), chain[full - 1] if full else st.root, prompt[start:start + t - 1],
                         full, len(prompt) - 1 - start, self.config.key_seed, whole=whole)
        if tail is not None:
            st.fetch_keys += int(tail.tier != Tier.RAM)
            where = {Tier.DISK: "served_tokens_disk", Tier.PEER: "served_tokens_peer"}.get(Tier(tail.tier),
                                                                                       "served_tokens_ram")
            self.counters.add(tail_hit_tokens=tail.tokens, **{where: tail.tokens})
        return tail
    def _tail_after_finish(self, st: ReqState, block_ids: Sequence[int] | None) -> bool:
        """request_finished's answer: True when the request's tail could not be saved in its last step and is
        queued for the next one (vLLM keeps its blocks until the worker reports it sent)."""
        if not self.tails or st.tail_saved or self.config.save != "all" or st.loading is not None:
            return False  # saved already, or its tail is the prompt's (saved with its last token or never)
        req: Any = st.request
        # the tokens whose KV a forward has written (with async scheduling, the next step's may be scheduled)
        written = req.num_computed_tokens - (getattr(req, "num_in_flight_tokens", 0) or 0)
        table = list(block_ids) if block_ids is not None else (st.block_ids[0] if st.block_ids else [])
        job = self._tail_job(st, req.all_token_ids or [], written, table, release=True)
        if job is None:
            return False
        self._tail_saves.append(job)
        return True

    def _final_tail(self, st: ReqState, num_scheduled_tokens: int) -> SaveJob | None:
        """The request's partial last block, saved in the step whose forward writes the last of its KV, so vLLM
        need not hold its blocks after it finishes: with save "prompt", the step that computes the prompt's last
        token; with "all", the step that samples the request's last token (max_tokens: a request that stops
        sooner, on EOS or a stop string, has its tail saved after it finishes, request_finished)."""
        if not self.tails or st.tail_saved or self.config.save == "off":
            return None
        req = st.request
        prompt = req.prompt_token_ids or []
        computed = req.num_computed_tokens + num_scheduled_tokens
        if self.config.save == "prompt":
            if computed < len(prompt):
                return None
            st.tail_saved = True  # its only tail, saved or not
            return self._tail_job(st, prompt, len(prompt), st.block_ids[0] if st.block_ids else [], release=False)
        max_tokens = getattr(req, "max_tokens", None)
        if not isinstance(max_tokens, int) or computed < len(prompt) + max_tokens - 1:
            return None
        st.tail_saved = True
        return self._tail_job(st, req.all_token_ids or [], computed, st.block_ids[0] if st.block_ids else [],
                              release=False)

    def _tail_job(self, st: ReqState, tokens: Sequence[int], computed: int, table: list[int], *,
                  release: bool) -> SaveJob | None:
        """The save of the partial block after the full keys of ``tokens[:computed]`` (KV written), from its
        block in ``table``; None where there is none, its block is unknown, or a full key before it is not
        stored."""
        t = self.tokens_per_key
        full = min(computed, len(tokens)) // t
        if full >= len(table) or table[full] < 0:
            return None
        keys = self._extend(st, tokens[:full * t])
        tail = finished_tail(keys[full - 1] if full else st.root, tokens, computed, t, st.stored_keys,
                             self.config.key_seed)
        if tail is None:
            return None
        self.counters.add(tail_saves=1)
        return SaveJob(st.request.request_id, st.salt, [tail.key], [[table[full]]], release=release)
