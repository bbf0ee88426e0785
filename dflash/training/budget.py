"""A run's length from a budget of minutes (--max-minutes): the steps that fit are estimated again
as the run goes, and the learning-rate curve is spread over them.

The pace (seconds per optimizer step) is measured from step PACE_FROM on: the first steps carry the
compilation of the first shapes, and a pace taken over them would plan a run a fraction of its
length, whose warmup and early decay the later estimates could not undo. Every REPLAN_EVERY steps
after PACE_FROM the drafter ranks agree on the training time spent and on that pace (the largest
over the ranks, so they plan the same total); the steps that fit the rest of the budget at that
pace, capped by --epochs and --max-steps, become the run's total, and LRSchedule.rebase spreads the
rest of its curve over them: the learning rate never jumps, and its decay ends at the last step
that fits. Before the first estimate the run follows the curve of its cap (its warmup barely
begun). The pace includes the periodic evals and checkpoints and any later compilation, since they
recur in the steps to come. A budget found spent ends the run at that step. Between two estimates
the total stands, so a run ends within a few steps of its budget.

Time counts from the first step: the steps, the periodic evals and the checkpoints, not the set-up
before them or the final eval after. Checkpoints record the time spent, so a resumed run goes on
with what is left of the same budget (the minutes between the crash and the resume do not count).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

PACE_FROM = 3  # optimizer steps (from the run's start or resume) before the pace is measured
REPLAN_EVERY = 10  # optimizer steps between estimates


def steps_that_fit(step: int, spent_s: float, seconds_per_step: float, budget_s: float, cap: int) -> int:
    """The run's total: the `step`s done, then as many as the rest of the budget holds at
    `seconds_per_step`, at most `cap` in all; `step` itself once the budget is spent."""
    if spent_s >= budget_s:
        return step
    return max(step, min(cap, step + int((budget_s - spent_s) / max(seconds_per_step, 1e-9))))


class TimeBudget:
    """The training time a run may spend, and when to estimate the steps that fit it. Collective
    over the drafter group: every drafter rank calls `replan` after each optimizer step."""

    def __init__(self, minutes: float, cap: int, group=None, device: torch.device | None = None,
                 spent_s: float = 0.0, clock=time.monotonic) -> None:
        self.budget_s, self.cap, self.group, self.device = 60.0 * minutes, cap, group, device
        self._spent_before, self._clock = spent_s, clock
        self._started: float | None = None
        self._since = (PACE_FROM, spent_s)  # (step, spent) the pace is measured from
        self._pace_from_set = False
        self.first_estimate = PACE_FROM + REPLAN_EVERY  # the step of the first estimate

    def start(self, step: int) -> None:
        """The clock runs from now; `step`: the optimizer step the run starts (or resumes) at."""
        self._started = self._clock()
        self._since = (step + PACE_FROM, self._spent_before)
        self._pace_from_set = False
        self.first_estimate = step + PACE_FROM + REPLAN_EVERY

    def spent(self) -> float:
        """Seconds of training spent, those before a resume included."""
        return self._spent_before + (self._clock() - self._started if self._started is not None else 0.0)

    def replan(self, step: int) -> int | None:
        """The run's new total at an estimate step (after optimizer step `step`), else None."""
        if not self._pace_from_set and step >= self._since[0]:  # a skipped step may not call at PACE_FROM
            self._since, self._pace_from_set = (step, self.spent()), True
        if step < self.first_estimate or (step - self.first_estimate) % REPLAN_EVERY:
            return None
        since_step, since_spent = self._since
        spent = self.spent()
        agreed = torch.tensor([spent, (spent - since_spent) / (step - since_step)], dtype=torch.float64,
                              device=self.device)
        if self.group is not None and dist.is_initialized():
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        spent, pace = agreed.tolist()
        return steps_that_fit(step, spent, pace, self.budget_s, self.cap)

    def state_dict(self) -> dict:
        return {"spent_s": self.spent()}

    def load_state_dict(self, state: dict) -> None:
        """Before `start`: the time the checkpointed run had spent."""
        self._spent_before = float(state["spent_s"])
