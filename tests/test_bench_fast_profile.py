"""bench.fast_profile at a tiny size: every fast-path request the client made is followed into the daemon (exact
counts per op), and every stage of its critical path is causal (never negative)."""

from __future__ import annotations

import json

from bench import fast_profile

ITERS = 20


def test_every_request_is_followed_into_the_daemon() -> None:
    out = fast_profile.run(n_keys=8, iters=ITERS)
    json.dumps(out)
    got = out["requests_attributed"]
    assert not [k for k in got if k.startswith("unattributed")], got
    # every key is in the shared key index: the lookup, probe and get_into scenarios make no request to follow
    # (their one-way HITS are not requests); puts go through the connection's spare slots: one Store each (the
    # puts', the two chains' and the get's block stored again, present) and one Spare each time the block size
    # changes (the chains' blocks, then the puts')
    assert got == {"Spare": 2, "Store": ITERS + 3}
    for op, stages in out["request_stages_us_p50"].items():
        for k in fast_profile.CRITICAL:
            assert stages[k] >= 0, (op, k, stages[k])
        assert stages["daemon: engine"] > 0 and stages["daemon: decode request"] > 0, op
    api = out["api_stages_us_p50"]
    assert set(api) == {"lookup", "probe_prefix", "put", "get_into"} and api["put"]["client: copy"] > 0
    assert set(out["plain_p50_us"]) == {"lookup", "probe_prefix", "put", "get_into", "echo"}
    fast_profile.report(out)
