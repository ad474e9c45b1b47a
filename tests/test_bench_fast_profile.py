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
    # lookups: the get_into's (with a lease); the lookup and probe scenarios (and their chain checks) are answered
    # by the client from the shared key index: no request (their one-way HITS are not requests to follow);
    # reserves: the puts', and one each for the two chains and the get's block stored again (present: no commit)
    assert (got["Lookup"], got["Reserve"], got["Commit"]) == (ITERS, ITERS + 3, ITERS)
    assert "Probe" not in got
    assert 1 <= got["Release"] <= ITERS  # a get's Release is queued; the client's thread may coalesce them
    for op, stages in out["request_stages_us_p50"].items():
        for k in fast_profile.CRITICAL:
            assert stages[k] >= 0, (op, k, stages[k])
        assert stages["daemon: engine"] > 0 and stages["daemon: decode request"] > 0, op
    api = out["api_stages_us_p50"]
    assert set(api) == {"lookup", "probe_prefix", "put", "get_into"} and api["put"]["client: copy"] > 0
    assert set(out["plain_p50_us"]) == {"lookup", "probe_prefix", "put", "get_into", "echo"}
    fast_profile.report(out)
