"""RestartBudget: restarts as a rate over a sliding window, with backoff, then a cool-down."""

from __future__ import annotations

from cluster.core.health import RestartBudget


def _budget(**kw) -> RestartBudget:
    args = dict(max_restarts=3, window_s=100.0, backoff_s=1.0, max_backoff_s=4.0, cooldown_s=60.0)
    return RestartBudget(**{**args, **kw})


def test_failures_in_a_row_back_off_exponentially_up_to_the_cap():
    b = _budget(max_restarts=10)
    delays = [b.on_failure(now=0.0).delay_s for _ in range(6)]
    assert delays == [0.0, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_a_served_step_resets_the_backoff_but_not_the_window():
    b = _budget()
    assert b.on_failure(0.0).delay_s == 0.0
    assert b.on_failure(1.0).delay_s == 1.0
    b.on_step_served()
    assert b.on_failure(5.0).delay_s == 0.0
    assert b.restarts_in_window(5.0) == 3
    assert b.on_failure(6.0).give_up


def test_the_budget_is_a_rate_old_restarts_leave_the_window():
    b = _budget(max_restarts=2, window_s=10.0)
    for t in (0.0, 20.0, 40.0, 60.0, 80.0):  # one crash every 20 s never exhausts 2 per 10 s
        d = b.on_failure(t)
        b.on_step_served()
        assert not d.give_up
    assert b.total_restarts == 5
    assert not b.on_failure(81.0).give_up
    b.on_step_served()
    d = b.on_failure(82.0)
    assert d.give_up and d.delay_s == 60.0


def test_after_the_cool_down_the_budget_is_fresh():
    b = _budget(max_restarts=1)
    assert not b.on_failure(0.0).give_up
    assert b.on_failure(0.5).give_up and b.give_ups == 1
    b.on_cooldown_over()
    assert b.restarts_in_window(61.0) == 0
    assert not b.on_failure(61.0).give_up


def test_zero_restarts_gives_up_at_the_first_failure():
    b = _budget(max_restarts=0)
    assert b.on_failure(0.0).give_up
