"""load_mode "auto" with blocks on disk, under vLLM 0.33's real Scheduler: a hit whose disk blocks fit
sync_fetch_bytes is scheduled in the step that admits it (the worker reads them while the step waits); one past
the budget waits in WAITING_FOR_REMOTE_KVS. Either way every loaded position holds what a forward writes and
the tokens are vLLM's. The connector's sides alone: tests/test_connector_sync_fetch.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvstore_connector.namespace import namespace_for
from kvstore.client import Client
from kvstore.testing import DaemonProcess, wait_until
from vllm.v1.request import RequestStatus

from .harness import BLOCK, HEAD_DIM, HEADS, LAYERS, SAMPLED, Harness
from .stored import PROMPT, chain_keys, daemon_keys


KEY_BYTES = LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 4  # one vLLM block: layers x (K, V) x tokens x heads x dim, f32


@pytest.fixture()
def disk_daemon() -> Iterator[DaemonProcess]:
    # disk_write = commit: the stored blocks are written behind, then demoted (the test waits for both)
    with DaemonProcess(arena_bytes="64MiB", max_block_bytes="8MiB", disk_bytes="64MiB", disk_segment_bytes="16MiB",
                       disk_sync="none", disk_write="commit") as d:
        yield d


@pytest.mark.parametrize("budget_keys,in_step", [(2, True), (1, False)])
def test_a_hit_with_two_blocks_on_disk(disk_daemon, model_dir, budget_keys: int, in_step: bool) -> None:
    h = Harness(model_dir, disk_daemon.address, extra={"blocks_per_key": 1, "load_mode": "auto",
                                                       "sync_fetch_bytes": budget_keys * KEY_BYTES})
    assert h.sched_side.spec.block_bytes == KEY_BYTES      # one stored block = one vLLM block, TP 1
    h.add("r1", PROMPT)
    h.run()
    assert h.scheduler.reset_prefix_cache()
    chain = chain_keys(6, PROMPT)
    assert sorted(daemon_keys(h, disk_daemon.address)) == sorted(chain)
    ns = namespace_for(h.sched_side.spec)
    with Client(disk_daemon.address) as c:
        tier = lambda: [i.tier for i in c.describe(ns, chain[4:6])]  # noqa: E731
        wait_until(lambda: tier() == ["ram+disk"] * 2, what="the last two blocks written behind")
        c.hint(ns, chain[4:6], "demote")
        wait_until(lambda: tier() == ["disk"] * 2, what="the last two blocks demoted")
    r2 = h.add("r2", list(PROMPT))
    out = h.step()
    if in_step:
        (job,) = out.kv_connector_metadata.plan.loads
        assert job.sync and len(job.keys) == 6
        assert out.num_scheduled_tokens["r2"] == 4 and r2.status == RequestStatus.RUNNING
    else:
        assert "r2" not in out.num_scheduled_tokens and r2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    h.run()
    assert (h.prefill["r2"].num_external_cached_tokens, h.prefill["r2"].num_local_cached_tokens) == (96, 0)
    assert h.kv_matches_tokens("r2", 101) and list(r2.output_token_ids) == [SAMPLED, SAMPLED]
    totals = h.sched_side.counters.totals
    assert (totals["served_tokens_disk"], totals["load_sync_requests"], totals.get("load_sync_fetch_requests", 0)) == (
        32, int(in_step), int(in_step))
    h.close()
