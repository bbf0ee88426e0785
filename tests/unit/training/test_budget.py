"""Tests for dflash.training.budget: the steps that fit a budget of minutes, and when they are
estimated (a fake clock stands for the run's time)."""

from __future__ import annotations

from dflash.training.budget import PACE_FROM, REPLAN_EVERY, TimeBudget, steps_that_fit
from dflash.training.schedules import LRSchedule


def test_the_steps_that_fit_are_the_rest_of_the_budget_at_the_pace_capped():
    assert steps_that_fit(step=10, spent_s=20.0, seconds_per_step=2.0, budget_s=60.0, cap=1000) == 30
    assert steps_that_fit(step=10, spent_s=20.0, seconds_per_step=2.0, budget_s=60.0, cap=25) == 25
    assert steps_that_fit(step=10, spent_s=61.0, seconds_per_step=2.0, budget_s=60.0, cap=1000) == 10
    assert steps_that_fit(step=10, spent_s=59.0, seconds_per_step=2.0, budget_s=60.0, cap=1000) == 10
    assert steps_that_fit(step=40, spent_s=20.0, seconds_per_step=2.0, budget_s=60.0, cap=25) == 40


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_pace_leaves_the_first_steps_out_and_takes_in_the_evals_that_recur():
    clock = FakeClock()
    budget = TimeBudget(minutes=1.0, cap=10_000, clock=clock)
    budget.start(step=0)
    totals = {}
    for step in range(1, 40):
        clock.now += 5.0 if step == 1 else 0.5  # the first step compiles
        clock.now += 2.5 if step == 20 else 0.0  # a periodic eval
        totals[step] = budget.replan(step)
    estimates = {step: total for step, total in totals.items() if total is not None}
    first = PACE_FROM + REPLAN_EVERY
    assert sorted(estimates) == list(range(first, 40, REPLAN_EVERY))
    # PACE_FROM steps took 6 s; from there 0.5 s a step: the compiling step would have made it 2 s
    spent = 6.0 + 0.5 * REPLAN_EVERY
    assert estimates[first] == first + int((60 - spent) / 0.5)
    step, spent = first + REPLAN_EVERY, 6.0 + 0.5 * 2 * REPLAN_EVERY + 2.5
    assert estimates[step] == step + int((60 - spent) / ((spent - 6.0) / (2 * REPLAN_EVERY)))


def test_a_first_estimate_over_the_compiling_steps_would_have_planned_a_fraction_of_the_run():
    """What went wrong before the pace left the first steps out: 37.6 s for 3 steps (compiling) then
    0.5 s a step planned 19 steps of a 4-minute run, and its warmup and stable phase with them."""
    assert steps_that_fit(step=3, spent_s=37.6, seconds_per_step=37.6 / 3, budget_s=240.0, cap=10_000) == 19
    clock = FakeClock()
    budget = TimeBudget(minutes=4.0, cap=10_000, clock=clock)
    budget.start(step=0)
    clock.now += 37.6
    assert [budget.replan(step) for step in range(1, PACE_FROM + 1)] == [None] * PACE_FROM
    for step in range(PACE_FROM + 1, PACE_FROM + REPLAN_EVERY + 1):
        clock.now += 0.5
        total = budget.replan(step)
    assert total == PACE_FROM + REPLAN_EVERY + int((240.0 - 37.6 - 0.5 * REPLAN_EVERY) / 0.5)


def test_a_resumed_budget_goes_on_with_the_time_spent_before():
    clock = FakeClock()
    first = TimeBudget(minutes=1.0, cap=10_000, clock=clock)
    first.start(step=0)
    clock.now += 50.0
    saved = first.state_dict()
    assert saved == {"spent_s": 50.0}
    clock.now += 1000.0  # the crash and the restart do not count
    resumed = TimeBudget(minutes=1.0, cap=10_000, clock=clock)
    resumed.load_state_dict(saved)
    resumed.start(step=20)
    for step in range(21, 21 + PACE_FROM + REPLAN_EVERY):
        clock.now += 0.25
        total = resumed.replan(step)
    step = 20 + PACE_FROM + REPLAN_EVERY
    assert total == step + int((60 - 50.0 - 0.25 * (PACE_FROM + REPLAN_EVERY)) / 0.25)
    for step in range(step + 1, step + REPLAN_EVERY + 1):
        clock.now += 1.0  # slower now: the budget runs out, and the run ends at the estimate
        total = resumed.replan(step)
    assert total == step


def test_the_lr_curve_spread_over_an_estimate_keeps_its_shape_and_ends_at_the_last_step():
    curve = LRSchedule(total_steps=100_000, warmup_ratio=0.04, kind="wsd", decay_ratio=0.2)
    value = curve(3)
    curve.rebase(3, 503)  # the first estimate: 500 more steps fit
    assert curve(3) == value
    assert curve.last_step() == 503
    lrs = [curve(step) for step in range(3, 504)]
    assert max(lrs) == 1.0 and lrs[-1] == 0.0
    assert abs(sum(lr < 1.0 for lr in lrs[30:]) - 100) <= 1  # the decay: the last 20% of the 500 steps


def test_the_pace_starts_at_the_first_step_seen_from_step_3_on_when_step_3_itself_is_not_seen():
    """A step the spike guard skips whole calls no estimate: the pace is then measured from the
    next step taken, not from the start (which holds the compilation)."""
    clock = FakeClock()
    budget = TimeBudget(minutes=1.0, cap=10_000, clock=clock)
    budget.start(step=0)
    clock.now += 20.0  # steps 1..4 compile; no call at step 3
    assert budget.replan(4) is None
    for step in range(5, PACE_FROM + REPLAN_EVERY + 1):
        clock.now += 0.5
        total = budget.replan(step)
    step = PACE_FROM + REPLAN_EVERY
    assert total == step + int((60 - 20.0 - 0.5 * (step - 4)) / 0.5)
