"""S3-FIFO eviction policy, scripted: exact victim sequences for the small and main queues, the ghost of
evicted fingerprints, frequencies, pinned entries and id reuse (helpers: tests/policy_helpers.py).
"""

from __future__ import annotations

import pytest

from kvstore.policies.s3fifo import S3FIFOPolicy
from tests.policy_helpers import drain, eligible_any, eligible_unless, insert


# ----------------------------------------------------------------- S3-FIFO


def test_s3fifo_one_hit_wonders_leave_before_accessed_entries() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # insert 1..4 into S, access 1, 2
    insert(p, 1, 2, 3, 4)
    p.on_access(1)
    p.on_access(2)
    # evicting from S: 1 and 2 were accessed -> move to M; 3 is evicted
    assert p.choose_victim(eligible_any) == 3
    assert (p.small_len, p.main_len) == (1, 2)
    # S={4} is still >= 10% of 3 entries -> 4 goes next, then M in FIFO order
    assert drain(p) == [4, 1, 2]
    # 3 and 4 (never accessed, evicted from S) are remembered by the ghost
    assert p.ghost_len == 2


def test_s3fifo_small_queue_share_decides_which_queue_evicts() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # insert 1..10, access each once, insert 11, 12
    insert(p, *range(1, 11))
    for eid in range(1, 11):
        p.on_access(eid)
    insert(p, 11, 12)
    # S tail 1..10 are promoted to M (frequency reset), 11 is evicted
    assert p.choose_victim(eligible_any) == 11
    # S={12} is 1 of 11 < 10% share -> evict from M: 1 (freq 0 after promotion)
    assert p.choose_victim(eligible_any) == 1
    # now 1 of 10 >= 10% -> 12 leaves S; then M drains in FIFO order
    assert drain(p) == [12, 2, 3, 4, 5, 6, 7, 8, 9, 10]


def test_s3fifo_ghost_hit_goes_straight_to_main() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # insert 1 (fp 101), evict it -> its fingerprint enters the ghost
    p.on_insert(1, 101)
    assert p.choose_victim(eligible_any) == 1
    assert p.ghost_len == 1
    # insert 2 (fp 102), 3 (fp 101: ghost hit -> M), 4 (fp 104)
    p.on_insert(2, 102)
    p.on_insert(3, 101)
    p.on_insert(4, 104)
    assert (p.small_len, p.main_len) == (2, 1)
    assert p.ghost_len == 0  # a hit consumes the ghost entry
    # S={2,4} drains first, 3 (in M) last -> victims 2, 4, 3
    assert drain(p) == [2, 4, 3]


def test_s3fifo_without_ghost_hit_is_plain_fifo() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # same script as above but 3 has a new fingerprint -> victims 2, 3, 4
    p.on_insert(1, 101)
    assert p.choose_victim(eligible_any) == 1
    p.on_insert(2, 102)
    p.on_insert(3, 103)
    p.on_insert(4, 104)
    assert drain(p) == [2, 3, 4]


def test_s3fifo_zero_fingerprint_is_never_remembered() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # insert 1 (fp 0), evict, insert 2 (fp 0) -> no ghost hit, 2 goes to S
    p.on_insert(1, 0)
    assert p.choose_victim(eligible_any) == 1
    assert p.ghost_len == 0
    p.on_insert(2, 0)
    assert (p.small_len, p.main_len) == (1, 0)


def test_s3fifo_main_reinserts_with_decremented_frequency() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # insert 1..3, access each, insert 4 -> 1..3 promoted to M, 4 evicted
    insert(p, 1, 2, 3)
    for eid in (1, 2, 3):
        p.on_access(eid)
    insert(p, 4)
    assert p.choose_victim(eligible_any) == 4
    # M tail->head: 1, 2, 3 (all freq 0). access 1 twice (freq 2), 2 once (freq 1)
    p.on_access(1)
    p.on_access(1)
    p.on_access(2)
    # 1: freq 2->1, reinserted; 2: freq 1->0, reinserted; 3: freq 0 -> victim
    assert p.choose_victim(eligible_any) == 3
    # 1: freq 1->0, reinserted; 2: freq 0 -> victim; then 1
    assert drain(p) == [2, 1]


def test_s3fifo_frequency_saturates_at_three() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # 1 and 2 in M; access 1 ten times (freq capped at 3), 2 three times
    insert(p, 1, 2)
    p.on_access(1)
    p.on_access(2)
    insert(p, 3)
    assert p.choose_victim(eligible_any) == 3
    for _ in range(10):
        p.on_access(1)
    for _ in range(3):
        p.on_access(2)
    # both decay 3->0 over three rotations; 1 is the tail when both reach 0
    assert drain(p) == [1, 2]


def test_s3fifo_ineligible_small_entry_is_reinserted_at_small_head() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # insert 1..3, pin 1 -> 1 would be evicted: re-inserted behind 3 instead
    insert(p, 1, 2, 3)
    assert p.choose_victim(eligible_unless({1})) == 2
    assert drain(p) == [3, 1]


def test_s3fifo_ineligible_main_entry_is_reinserted_at_main_head() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # 1..3 promoted to M (see above), pin 1 -> victims 2, then 3, 1
    insert(p, 1, 2, 3)
    for eid in (1, 2, 3):
        p.on_access(eid)
    insert(p, 4)
    assert p.choose_victim(eligible_any) == 4
    assert p.choose_victim(eligible_unless({1})) == 2
    assert drain(p) == [3, 1]


def test_s3fifo_falls_back_to_small_when_main_is_all_pinned() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # insert 1..19, access each, insert 20, 21 -> 1..19 promoted to M, 20 evicted
    insert(p, *range(1, 20))
    for eid in range(1, 20):
        p.on_access(eid)
    insert(p, 20, 21)
    assert p.choose_victim(eligible_any) == 20
    # S={21} is under its 10% share so M is tried first, but all of M is pinned
    pinned = eligible_unless(set(range(1, 20)))
    assert p.choose_victim(pinned) == 21
    assert p.choose_victim(pinned) is None
    assert len(p) == 19


def test_s3fifo_promoted_entry_found_after_main_fallback() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # same setup; 21 is accessed: M fails, S promotes 21 to M, M is retried
    insert(p, *range(1, 20))
    for eid in range(1, 20):
        p.on_access(eid)
    insert(p, 20, 21)
    assert p.choose_victim(eligible_any) == 20
    p.on_access(21)
    assert p.choose_victim(eligible_unless(set(range(1, 20)))) == 21
    assert len(p) == 19


def test_s3fifo_id_reuse_starts_fresh() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # insert 1..3, access 2, remove 2, insert 2 again (fresh, freq 0), insert 4
    insert(p, 1, 2, 3)
    p.on_access(2)
    p.on_remove(2)
    assert 2 not in p and len(p) == 2
    insert(p, 2, 4)
    # a stale freq on 2 would promote it and give 1, 3, 4, 2
    assert drain(p) == [1, 3, 2, 4]
    # removal is not an eviction: a removed entry never enters the ghost
    q = S3FIFOPolicy(ghost_entries=16)
    insert(q, 1)
    q.on_remove(1)
    assert q.ghost_len == 0


def test_s3fifo_ghost_is_bounded() -> None:
    p = S3FIFOPolicy(ghost_entries=3)
    # evict 10 one-hit wonders (fps 1001..1010): only the last 3 are kept
    insert(p, *range(1, 11))
    assert drain(p) == list(range(1, 11))
    assert p.ghost_len == 3
    # 1008 is remembered (M), 1007 was forgotten (S)
    p.on_insert(8, 1008)
    p.on_insert(7, 1007)
    assert (p.small_len, p.main_len) == (1, 1)


def test_s3fifo_default_ghost_bound_follows_tracked_count() -> None:
    p = S3FIFOPolicy()
    # 100 tracked; evicting 10 one-hit wonders leaves 90 tracked -> all 10 fit
    insert(p, *range(100))
    for _ in range(10):
        p.choose_victim(eligible_any)
    assert p.ghost_len == 10
    # draining everything shrinks the bound with the tracked count
    drain(p)
    assert p.ghost_len == 0


def test_s3fifo_rejects_bad_options() -> None:
    with pytest.raises(ValueError):
        S3FIFOPolicy(small_fraction=0.0)
    with pytest.raises(ValueError):
        S3FIFOPolicy(small_fraction=1.0)
    with pytest.raises(ValueError):
        S3FIFOPolicy(ghost_entries=-1)
