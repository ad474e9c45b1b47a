"""Claims under two real vLLM v1 Schedulers on one daemon (two vLLM instances on one node; across nodes the same
path goes through the owner: tests/test_connector_claims.py): the second one gets the same prompt while the first
one's step computing it runs. Its lookup finds the blocks claimed, vLLM puts the request in
WAITING_FOR_REMOTE_KVS, its worker waits for the first one's save and loads it, and vLLM computes only the last
token: the loaded blocks hold exactly what the first one's forward wrote. Without claims it computes them all."""

from __future__ import annotations

import threading

from vllm.v1.request import RequestStatus

from .harness import SAMPLED, Harness

PROMPT = [(13 * i + 5) % 1000 + 10 for i in range(100)]  # 6 full blocks of 16 and 4 tokens


def _second_during_first_step(first: Harness, second: Harness) -> list[BaseException]:
    """Run `second`'s step (admitting r2) on a thread started between `first`'s schedule and its forward; the
    first's save lands while the second's worker waits. The thread's errors, after it is joined."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            second.add("r2", list(PROMPT))
            second.step()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    thread = threading.Thread(target=run)

    def hook(_out: object) -> None:
        first.before_worker = None
        thread.start()
        # the second scheduler's lookup has answered before the first one's forward writes and saves anything
        pause = threading.Event()
        for _ in range(500):
            if second.steps:           # its schedule() (the lookup) has run
                return
            pause.wait(0.01)
        raise AssertionError("the second scheduler did not schedule while the first one's step ran")

    first.before_worker = hook
    first.add("r1", PROMPT)
    first.step()                       # r1's whole prompt in this step; its blocks saved at its end
    thread.join(30)
    assert not thread.is_alive()
    return errors


def test_a_second_instance_waits_for_the_first_ones_save_and_computes_only_the_last_token(daemon, model_dir) -> None:
    first = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1})
    second = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1})
    assert _second_during_first_step(first, second) == []
    r2 = second.scheduler.requests["r2"]
    assert r2.status == RequestStatus.WAITING_FOR_REMOTE_KVS     # its worker loaded; vLLM hears it next step
    assert second.load_jobs == [(0, "r2")] and len(second.steps[0].kv_connector_metadata.plan.loads[0].keys) == 6
    first.run(), second.run()
    assert (second.prefill["r2"].num_external_cached_tokens, second.prefill["r2"].num_local_cached_tokens) == (96, 0)
    assert second.tracked["r2"].scheduled_tokens == 4 + 1      # the 4-token tail and one decode step
    assert second.kv_matches_tokens("r2", 101)                 # the first instance's bytes, as a forward writes them
    assert list(r2.output_token_ids) == [SAMPLED, SAMPLED]
    t = second.worker.counters.totals
    assert (t["claim_waits"], t["claim_waits_served"], t["loaded_blocks"], t.get("load_failed_blocks", 0)) == (
        1, 1, 6, 0)
    assert first.sched_side.counters.totals["claimed_keys"] == 6
    assert second.sched_side.counters.totals["claim_pending_keys"] == 6
    first.close(), second.close()


def test_without_claims_the_second_instance_computes_the_prompt(daemon, model_dir) -> None:
    first = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1, "claim_ms": 0})
    second = Harness(model_dir, daemon.address, extra={"blocks_per_key": 1, "claim_ms": 0})
    assert _second_during_first_step(first, second) == []
    first.run(), second.run()
    assert second.load_jobs == [] and second.tracked["r2"].scheduled_tokens == 100 + 1
    assert second.prefill["r2"].num_external_cached_tokens == 0
    first.close(), second.close()
