"""Client.hint: an agent's hint on keys through the Hint RPC, in batches of the daemon's max_batch_keys.

gRPC only, like Explain: a hint is a control message an orchestrator sends while no generation runs (a tool
wait), a few per turn, so the same-node fast path has nothing to gain. The daemon checks the action and ttl
(kvstore/engine/hints.py parse_hint), so a bad one is an InvalidRequestError with the daemon's own words,
whichever way it came in; only a ttl that is not a number at all is refused here (protobuf could not send it).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.batches import chunks
from kvstore.client.rpc import Rpc
from kvstore.errors import InvalidRequestError, KVStoreError
from kvstore.hint_vocab import HintAction, HintOutcome

__all__ = ["hint"]


def hint(rpc: Rpc, namespace: str, keys: Sequence[bytes], action: HintAction | str, ttl_s: float,
         batch: int) -> list[HintOutcome]:
    """One HintOutcome per key, in order. No keys: no call, []."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)):
        raise InvalidRequestError(f"hint ttl_s={ttl_s!r}: use a finite number of seconds >= 0")
    word = action.value if isinstance(action, HintAction) else str(action)
    out: list[HintOutcome] = []
    for part in chunks(len(keys), batch):
        got = rpc.call("Hint", pb.HintRequest(namespace=namespace, keys=keys[part], action=word,
                                              ttl_s=float(ttl_s))).outcomes
        if len(got) != part.stop - part.start:
            raise KVStoreError(f"the daemon answered {len(got)} hint outcomes for {part.stop - part.start} keys")
        out.extend(HintOutcome(o) for o in got)
    return out
