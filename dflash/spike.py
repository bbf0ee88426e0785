"""Loss-spike guard for the engine step.

DeepSpeed's only skip is its fp16/bf16 overflow path; a loss spike or a NaN that does not
overflow goes straight into the weights. The guard looks at each micro-batch's loss BEFORE
backward: a non-finite loss, or one above `factor` x the running mean of accepted losses (after
`warmup` accepted micro-batches), is skipped on EVERY drafter rank (the decision is all-reduced,
since ZeRO's gradient reduction during backward is collective). A skipped micro-batch never
reaches the engine, so weights, optimizer moments, LR schedule and the engine's step counters
are untouched and stay coherent.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


class SpikeGuard:
    def __init__(self, factor: float, warmup: int = 20, decay: float = 0.98, group=None):
        self.factor, self.warmup, self.decay, self.group = factor, warmup, decay, group
        self.mean: float | None = None
        self.accepted = 0
        self.skipped = 0

    def _locally_bad(self, value: float) -> bool:
        if not math.isfinite(value):
            return True
        warm = self.factor > 0 and self.mean is not None and self.accepted >= self.warmup
        return warm and value > self.factor * self.mean

    def _any_rank(self, bad: bool, device: torch.device) -> bool:
        flag = torch.tensor([1.0 if bad else 0.0], device=device)
        if self.group is not None and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item() > 0)

    def should_skip(self, loss: torch.Tensor, track: bool = True) -> bool:
        """True when any drafter rank saw a spike or a non-finite loss in this micro-batch.
        Collective: every drafter rank calls it each micro-batch; `track=False` (a rank with
        no samples this step) votes without moving the running mean."""
        value = float(loss.detach().float())
        if self._any_rank(track and self._locally_bad(value), loss.device):
            self.skipped += 1
            return True
        if not track:
            return False
        self.accepted += 1
        self.mean = value if self.mean is None else self.decay * self.mean + (1 - self.decay) * value
        return False
