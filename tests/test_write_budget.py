"""The disk write budget (kvstore/policies/write_budget.py) on a clock the test moves: the window's cap, the
probability that follows the budget, larger blocks refused first, Demote's charge, and idle windows.
"""

from __future__ import annotations

from kvstore.policies.write_budget import WriteBudget


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_window_never_admits_past_its_target() -> None:
    clock = Clock()
    b = WriteBudget(100, window_s=10.0, clock=clock, max_block_bytes=400)  # 1,000 bytes a window
    assert [b.admit(400) for _ in range(3)] == [True, True, False]     # 800 admitted; 1,200 would pass 1,000
    assert b.admit(200) is True and b.admit(1) is False               # 1,000 exactly, then nothing
    s = b.state()
    assert (s.window_admitted, s.window_target, s.admitted_blocks, s.refused_blocks) == (1000, 1000, 3, 2)
    assert (s.admitted_bytes, s.refused_bytes, s.probability) == (1000, 401, 1.0)


def test_the_next_window_admits_with_the_probability_the_budget_leaves() -> None:
    clock = Clock()
    b = WriteBudget(100_000, window_s=10.0, clock=clock, seed=3, max_block_bytes=4000)  # 1e6 bytes a window
    for _ in range(250_000):                                       # window 0: 1e8 bytes offered, 1e6 admitted
        b.admit(400)
    clock.now = 10.0                                               # window 1: p = 1e6 / 1e8
    assert b.state().probability == 0.01
    small = sum(b.admit(200) for _ in range(20_000))               # half the mean size: p x 2
    usual = sum(b.admit(400) for _ in range(20_000))               # the mean size: p
    large = sum(b.admit(4000) for _ in range(20_000))              # 10x the mean: p / 10
    assert 330 < small < 470 and 150 < usual < 250 and 5 < large < 40   # ~400, ~200, ~20 (seeded draws)
    assert b.state().window_admitted == 200 * small + 400 * usual + 4000 * large < 1_000_000


def test_a_demote_is_charged_and_idle_windows_start_afresh() -> None:
    clock = Clock()
    b = WriteBudget(100, window_s=10.0, clock=clock, max_block_bytes=400)
    b.charge(900)                                                  # bypasses admission, counts against the window
    assert b.admit(400) is False and b.admit(100) is True
    clock.now = 35.0                                               # windows 1 and 2 saw no offer: p back to 1
    assert b.state().probability == 1.0 and b.state().window_admitted == 0
    assert b.admit(400) is True
