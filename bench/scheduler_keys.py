"""The scheduler side's keys of an agent's next turn: hashed from scratch, through the key memo, and the limit.

An agent session resends its whole context every turn (the workload: median 43 turns, ~142K prompt tokens by the
end, >96 % of each prompt seen before). vLLM's scheduler step asks the connector for every new request's hit
(get_num_new_matched_tokens), and the connector first needs the request's keys: a chain over its token ids
(kvstore_connector/keys.py). Measured for the session's last turn, the same requests each way, round-robin
(bench/_common.py, medians):
  scratch   SchedulerSide._extend with no memo: every chunk hashed (the connector before the memo);
  memo      the same with the key memo warm from the previous turn (kvstore_connector/key_memo.py): the seen chunks
            found by vLLM's block hashes, only the new ones hashed;
  limit     the least work that finds the seen keys: one dict lookup a chunk by vLLM's hash (a list
            comprehension), plus the new chunks hashed as the chain does.
vLLM's own block hashing of the request (which it does anyway for its prefix cache) is shown for scale, not
timed in any case. The requests carry vLLM's real block hashes where vLLM is importable (its
get_request_block_hasher, SHA-256), else a SHA-256 chain of the same shape (said in the output). The last stdout
line is one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench._common import Case, emit_json, interleave, print_table
from kvstore_connector.config import ConnectorConfig
from kvstore_connector.key_memo import KeyMemo
from kvstore_connector.keys import KeyChain, chain_root
from kvstore_connector.link import StoreLink
from kvstore_connector.namespace import KVLayoutSpec
from kvstore_connector.scheduler import SchedulerSide

__all__ = ["main", "run", "block_hash_chain"]

BLOCK = 16  # vLLM's default GPU block size


@dataclass
class Turn:
    """The attributes of vLLM's Request the scheduler side reads for keys, with its block hashes."""

    request_id: str
    prompt_token_ids: list[int]
    block_hashes: list[Any]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids


def block_hash_chain(tokens: Sequence[int], block: int = BLOCK, salt: str = "") -> list[bytes]:
    """Block hashes of vLLM's shape without vLLM: SHA-256 chained over blocks of `block` tokens (`salt` in the
    first, as vLLM puts a cache_salt), each naming the whole prefix up to its block's end."""
    out, prev = [], salt.encode()
    for i in range(len(tokens) // block):
        prev = hashlib.sha256(prev + repr(list(tokens[i * block:(i + 1) * block])).encode()).digest()
        out.append(prev)
    return out


def _hasher() -> tuple[Callable[[list[int]], list[Any]], str]:
    """vLLM's block hasher where vLLM is importable, else a SHA-256 chain of the same shape."""
    try:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request
    except ImportError:
        return block_hash_chain, "a SHA-256 chain of vLLM's shape (vLLM not importable here)"
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)

    def real(tokens: list[int]) -> list[Any]:
        return list(Request("r", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher).block_hashes)
    return real, "vLLM's get_request_block_hasher (SHA-256)"


def session(turns: int, final_tokens: int, output: int, seed: int) -> list[list[int]]:
    """Each turn's prompt: the previous prompt, its output and new tokens (tool results, a user message)."""
    rng = random.Random(seed)
    per_turn = max(1, (final_tokens - turns * output) // turns)
    prompts: list[list[int]] = []
    context: list[int] = []
    for _ in range(turns):
        context = context + [rng.randrange(150_000) for _ in range(per_turn)]
        prompts.append(context)
        context = context + [rng.randrange(150_000) for _ in range(output)]
    return prompts


def side(tokens_per_key: int, memo: KeyMemo | None) -> SchedulerSide:
    spec = KVLayoutSpec(model="bench/keys", dtype="bfloat16", block_size=BLOCK, num_layers=32, num_kv_heads=8,
                        head_dim=128, tp_rank=0, tp_size=1, blocks_per_key=tokens_per_key // BLOCK)
    cfg = ConnectorConfig.from_extra({"address": "/nonexistent/kvstore.sock",
                                      "blocks_per_key": tokens_per_key // BLOCK})
    return SchedulerSide(cfg, spec, StoreLink("/nonexistent/kvstore.sock", timeout_s=0.2), key_memo=memo)


def run(tokens_per_key: Sequence[int], turns: int, final_tokens: int, output: int, rounds: int,
        seed: int = 0) -> tuple[dict[str, Any], list[list[object]]]:
    hash_blocks, hasher_kind = _hasher()
    prompts = session(turns, final_tokens, output, seed)
    prev, last = prompts[-2], prompts[-1]
    t0 = time.perf_counter()
    prev_hashes, last_hashes = hash_blocks(prev), hash_blocks(last)
    vllm_s = (time.perf_counter() - t0) / 2
    out: dict[str, Any] = {"bench": "scheduler_keys", "hasher": hasher_kind, "turns": turns,
                           "last_prompt_tokens": len(last), "new_tokens_last_turn": len(last) - len(prev),
                           "vllm_block_hashing_ms": round(vllm_s * 1e3, 2), "by_tokens_per_key": {}}
    rows: list[list[object]] = []
    n = [0]
    for t in tokens_per_key:
        g = t // BLOCK
        memo = KeyMemo()
        warm = side(t, memo)
        warm._extend(warm._state(Turn("prev", prev, prev_hashes)), prev)  # the previous turn, remembered
        scratch_side, memo_side = side(t, None), side(t, memo)
        seen = {h: k for h, k in zip(prev_hashes[g - 1::g], KeyChain(t, 0, chain_root(0)).extend(prev))}
        expect = KeyChain(t, 0, chain_root(0)).extend(last)

        def keys_case(s: SchedulerSide) -> Case:
            def fn(_: object) -> None:
                n[0] += 1
                req = Turn(f"last{n[0]}", last, last_hashes)
                got = s._extend(s._state(req), last)
                s._reqs.pop(req.request_id)
                if got != expect:
                    raise AssertionError("the keys differ from the keys hashed from scratch")
            return Case(fn)

        def limit(_: object) -> None:
            found = [seen[h] for h in last_hashes[g - 1::g] if h in seen]
            chain = KeyChain(t, 0, chain_root(0))
            chain.adopt(found)
            if chain.extend(last) != expect:
                raise AssertionError("the limit's keys differ")

        res = interleave({"scratch": keys_case(scratch_side), "memo": keys_case(memo_side), "limit": Case(limit)},
                         warmup=2, min_iters=rounds, max_iters=rounds, budget_s=0.0)
        ms = {k: v.p50 * 1e3 for k, v in res.items()}
        out["by_tokens_per_key"][str(t)] = {"keys": len(expect), "scratch_ms": round(ms["scratch"], 3),
                                           "memo_ms": round(ms["memo"], 3), "limit_ms": round(ms["limit"], 3),
                                           "memo_vs_scratch": round(ms["memo"] / ms["scratch"], 3),
                                           "memo_vs_limit": round(ms["memo"] / ms["limit"], 3)}
        rows.append([t, len(expect), f"{ms['scratch']:.2f}", f"{ms['memo']:.2f}", f"{ms['limit']:.2f}",
                     f"{ms['memo'] / ms['limit']:.2f}"])
    head = out["by_tokens_per_key"][str(tokens_per_key[0])]
    out.update(memo_ms=head["memo_ms"], scratch_ms=head["scratch_ms"], limit_ms=head["limit_ms"],
               memo_vs_scratch=head["memo_vs_scratch"], memo_vs_limit=head["memo_vs_limit"])
    return out, rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.scheduler_keys", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds (< 30 s)")
    ap.add_argument("--turns", type=int, default=43, help="turns of the session (default 43, the trace's median)")
    ap.add_argument("--tokens", type=int, default=142_000, help="the last turn's prompt tokens (default 142,000)")
    ap.add_argument("--output", type=int, default=444, help="output tokens a turn (default 444)")
    ap.add_argument("--tokens-per-key", default="64,16,256",
                    help="tokens per stored block, comma-separated multiples of 16 (the first is the JSON's headline)")
    ap.add_argument("--rounds", type=int, default=0, help="timed rounds (default 30, 10 with --quick)")
    args = ap.parse_args(argv)
    try:
        tpk = [int(x) for x in args.tokens_per_key.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--tokens-per-key: comma-separated integers, got {args.tokens_per_key!r}")
    if not tpk or any(t < BLOCK or t % BLOCK for t in tpk):
        ap.error(f"--tokens-per-key: positive multiples of {BLOCK}, got {args.tokens_per_key!r}")
    if args.turns < 2 or args.tokens < 2 * BLOCK * args.turns or args.output < 0:
        ap.error("--turns at least 2, --tokens at least 32 a turn, --output not negative")
    rounds = args.rounds or (10 if args.quick else 30)
    out, rows = run(tpk, args.turns, args.tokens, args.output, rounds)
    print(f"an agent session of {args.turns} turns, the last one's prompt {out['last_prompt_tokens']} tokens "
          f"({out['new_tokens_last_turn']} new); block hashes from {out['hasher']}: "
          f"{out['vllm_block_hashing_ms']} ms in vLLM for that prompt (not timed below)")
    print_table("the scheduler side's keys of the last turn (ms, p50)",
                ("tokens/key", "keys", "scratch", "memo", "limit", "memo/limit"), rows)
    emit_json(out)
    return out


if __name__ == "__main__":
    main()
