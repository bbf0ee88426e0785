"""Loss-spike guard for the engine step.

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
"""

from __future__ import annotations

import math
import statistics
from collections import deque

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
