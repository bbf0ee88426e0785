"""Loss-spike guard for the engine step, and the tally of skipped steps that stops a run which
can no longer learn.

DeepSpeed's only skip is its fp16/bf16 overflow path; a loss spike or a NaN that does not
overflow goes straight into the weights. The guard looks at each micro-batch's loss BEFORE
backward: a non-finite loss, or one above `factor` x the median of the last `window` accepted
losses (once `warmup` have been accepted), is skipped on EVERY drafter rank (the decision is
all-reduced, since ZeRO's gradient reduction during backward is collective). A skipped
micro-batch never reaches the engine, so weights, optimizer moments, LR schedule and the
engine's step counters are untouched and stay coherent.

Why a rolling median: the loss falls fast early in a run (from ~30 to ~5 in tens of steps), and
a running mean that remembers those first losses lets a 5x spike through long after; the
median of a short window follows the fall within half a window and ignores the spikes it
has let through.

A few skipped steps are the guard doing its job; most of the recent steps skipped (by the guard,
or by ZeRO for a gradient norm that is not finite) means the run cannot learn as it is, usually
a learning rate far too high, else bad data. Training on would export the weights of the last
step that got through (or none changed at all) under a final line that said all was well.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist


class SpikeGuard:
    def __init__(self, factor: float, warmup: int = 20, window: int = 50, group=None):
        self.factor, self.warmup, self.group = factor, warmup, group
        self._recent: deque[float] = deque(maxlen=window)
        self.accepted = 0
        self.skipped = 0

    @property
    def reference(self) -> float | None:
        """The median of the recent accepted losses, or None before any."""
        return statistics.median(self._recent) if self._recent else None

    def _locally_bad(self, value: float) -> bool:
        if not math.isfinite(value):
            return True
        warm = self.factor > 0 and self.accepted >= self.warmup and self._recent
        return bool(warm) and value > self.factor * self.reference

    def _any_rank(self, bad: bool, device: torch.device) -> bool:
        flag = torch.tensor([1.0 if bad else 0.0], device=device)
        if self.group is not None and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item() > 0)

    def should_skip(self, loss: torch.Tensor, track: bool = True) -> bool:
        """True when any drafter rank saw a spike or a non-finite loss in this micro-batch.
        Collective: every drafter rank calls it each micro-batch; `track=False` (a rank with
        no samples this step) votes without adding to the window."""
        value = float(loss.detach().float())
        if self._any_rank(track and self._locally_bad(value), loss.device):
            self.skipped += 1
            return True
        if track:
            self.accepted += 1
            self._recent.append(value)
        return False


SKIP_WINDOW = 20  # optimizer steps the stop rule looks back over
SKIP_MIN_STEPS = 4  # fewer attempted steps are no verdict (one NaN among the first three is not)


def too_many_skipped(skipped: Sequence[bool], window: int = SKIP_WINDOW, min_steps: int = SKIP_MIN_STEPS) -> bool:
    """More than half of the last `window` optimizer steps skipped (`skipped`: one flag per step,
    oldest first); early in a run, more than half of the steps so far once `min_steps` were
    attempted."""
    recent = list(skipped)[-window:]
    return len(recent) >= min_steps and 2 * sum(recent) > len(recent)


class SkippedStepsError(RuntimeError):
    """Most of the recent optimizer steps were skipped: the run stops, saying why and what to do."""


class StepTally:
    """The optimizer steps of this run, trained or skipped (and why). The same on every drafter
    rank: both skip decisions, the guard's and ZeRO's, are taken together by all of them."""

    def __init__(self) -> None:
        self.trained = 0
        self.skipped = 0
        self._recent: deque[tuple[int, str | None]] = deque(maxlen=SKIP_WINDOW)  # (step, why skipped)

    def add(self, step: int, skipped_because: str | None) -> None:
        self._recent.append((step, skipped_because))
        if skipped_because is None:
            self.trained += 1
        else:
            self.skipped += 1

    @property
    def failing(self) -> bool:
        return too_many_skipped([why is not None for _, why in self._recent])

    def summary(self) -> str:
        """Like "2 steps, skipped 8"."""
        return f"{self.trained} step{'' if self.trained == 1 else 's'}, skipped {self.skipped}"

    def error(self, lr: float, checkpoint: Path | None) -> SkippedStepsError:
        """The stop, naming the likely cause and the newest checkpoint (None: none was saved)."""
        skipped = [(step, why) for step, why in self._recent if why is not None]
        reasons = ", ".join(f"{count} {why}" for why, count in Counter(why for _, why in skipped).items())
        kept = (f"The newest checkpoint is {checkpoint}" if checkpoint is not None
                else "No checkpoint was saved (--save-every N keeps one every N steps)")
        return SkippedStepsError(
            f"training stopped: {len(skipped)} of the last {len(self._recent)} optimizer steps were skipped "
            f"({reasons}), the first at step {skipped[0][0]}; trained {self.summary()} in all. Likely cause: "
            f"the learning rate is too high (--lr {lr:g}): start again with a lower --lr (and --overwrite); else "
            f"bad data (the warnings above name the skipped steps). {kept}")
