"""Loss-spike guard for the engine step, and the tally of skipped steps that stops a run which
can no longer learn.

DeepSpeed's only skip is its fp16/bf16 overflow path; a loss spike or a NaN that does not
overflow goes straight into the weights. The guard judges each micro-batch's loss before its
gradient reaches the weights: a non-finite loss, or one above `factor` x the median of the last
`window` accepted losses (once `warmup` have been accepted), is skipped on EVERY drafter rank (the
decision is all-reduced, since ZeRO's gradient reduction during backward is collective).

The verdict is taken on the device (`vote`), against the limit the host already knows from the
losses before, so nothing waits for the forward to end: with one micro-batch a step, a skipped
one backpropagates NaN gradients (`poisoned`) and the engine skips the update as it does on
overflow (weights, optimizer moments and LR schedule untouched; the engine counts the step as
skipped), while the host queues the backward instead of waiting for the loss. `settle` reads the
verdict once the engine's step has read its gradient norm (the work is done by then). With
several micro-batches a step, a skipped one is left out of the step's gradient before its
backward (training reads the verdict at once, and replaces the micro-batch by a zero loss).

Why a rolling median: the loss falls fast early in a run (from ~30 to ~5 in tens of steps), and
a running mean that remembers those first losses lets a 5x spike through long after; the
median of a short window follows the fall within half a window and ignores the spikes it
has let through.

A few skipped steps are the guard doing its job; most of the recent steps skipped (by the guard,
or by ZeRO for a gradient norm that is not finite) means the run cannot learn as it is, usually
a learning rate far too high, else bad data. Training on would export the weights of the last
step that got through (or none changed at all) under a final line that said all was well. One
update that blows the weights up (their norm grown EXPLODING_GROWTH-fold in one step, or not
finite) says the same at once, whatever the run's length: a 2-step run at --lr 1e9 trains one
such step and would export weights of norm 1e9 as its drafter.

The guard's window and counts, and the tally's recent steps, are part of each checkpoint
(state_dict), so that a resumed run skips and stops exactly as the uninterrupted one.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from dflash.util.runtime import HostCopy


class SpikeGuard:
    def __init__(self, factor: float, warmup: int = 20, window: int = 50, group=None):
        self.factor, self.warmup, self.group = factor, warmup, group
        self._recent: deque[float] = deque(maxlen=window)
        self.accepted = 0
        self.skipped = 0
        self.last_loss = math.nan  # the loss of the last vote settled
        self._copy: HostCopy | None = None
        self._pending_track: bool | None = None  # the vote in flight (whether it tracks), None if none

    @property
    def reference(self) -> float | None:
        """The median of the recent accepted losses, or None before any."""
        return statistics.median(self._recent) if self._recent else None

    def limit(self) -> float | None:
        """The loss above which a micro-batch is a spike, once warm; None before (or factor 0)."""
        warm = self.factor > 0 and self.accepted >= self.warmup and self._recent
        return self.factor * self.reference if warm else None

    def vote(self, loss: torch.Tensor, track: bool = True) -> torch.Tensor:
        """This micro-batch's verdict, taken on the loss's device without waiting for it: [1]
        float, 1 where any drafter rank saw a spike or a non-finite loss. Collective: every drafter
        rank votes each micro-batch; `track=False` (a rank with no samples this step) votes no and
        adds nothing to the window. `settle` reads it."""
        value = loss.detach().float().reshape(1)
        bad = ~torch.isfinite(value)
        limit = self.limit()
        if limit is not None:
            bad = bad | (value.double() > limit)  # the host's float64 comparison, exactly
        flag = (bad & track).float()
        if self.group is not None and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if self._copy is None:
            self._copy = HostCopy(value.device)
        self._copy.start(torch.cat([value, flag]))
        self._pending_track = track
        return flag

    def settle(self) -> bool:
        """Read the last vote (waiting for it, where it is not done): True when it skips; a kept
        loss joins the window."""
        if self._pending_track is None:
            raise RuntimeError("SpikeGuard.settle without a vote to read")
        track, self._pending_track = self._pending_track, None
        self.last_loss, flag = self._copy.read()
        if flag > 0:
            self.skipped += 1
            return True
        if track:
            self.accepted += 1
            self._recent.append(self.last_loss)
        return False

    def should_skip(self, loss: torch.Tensor, track: bool = True) -> bool:
        """vote and settle at once: True when any drafter rank saw a spike or a non-finite loss."""
        self.vote(loss, track)
        return self.settle()

    def state_dict(self) -> dict:
        return {"recent": list(self._recent), "accepted": self.accepted, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self._recent = deque(state["recent"], maxlen=self._recent.maxlen)
        self.accepted, self.skipped = int(state["accepted"]), int(state["skipped"])


def poisoned(loss: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
    """The loss backward sees: `loss` itself where the vote `flag` [1] is 0 (bit for bit), else one
    whose every gradient is NaN, which the engine's step skips as an overflow."""
    return loss * torch.where(flag[0] > 0, math.nan, 1.0)


@contextlib.contextmanager
def gradient_scaled(engine, factor: float) -> Iterator[None]:
    """An engine.step() within applies `factor` x the gradient accumulated for it: to its norm,
    its clipping and the update. ZeRO stages 1 and 2 divide the accumulated gradient by their loss
    scale (1 in fp32 and bf16) before all three, so a loss scale of scale / factor does it without
    touching the gradient partitions. (Muon's 2-D updates are orthogonalised, the same at any
    factor.)"""
    if factor == 1.0:
        yield
        return
    optimizer = engine.optimizer
    before = optimizer.loss_scale
    optimizer.loss_scale = before / factor
    try:
        yield
    finally:
        optimizer.loss_scale = before


def weights_norm(module: torch.nn.Module, group=None) -> torch.Tensor:
    """The L2 norm of all the module's weights, the largest over `group`'s ranks (ZeRO 1/2 keep
    the same weights on each: the max makes their verdict one), as a [1] tensor on their device."""
    # one multi-tensor kernel for all of them: a norm each was a launch per tensor, every step
    norms = torch._foreach_norm([p.detach() for p in module.parameters()], 2, dtype=torch.float32)
    total = torch.linalg.vector_norm(torch.stack(norms)).reshape(1)
    if group is not None and dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    return total


SKIP_WINDOW = 20  # optimizer steps the stop rule looks back over
SKIP_MIN_STEPS = 4  # fewer attempted steps are no verdict (one NaN among the first three is not)
# One optimizer step that multiplies the weights' norm by more than this is a blow-up, not
# learning: an AdamW step moves each weight by about the learning rate. Measured per step over 30
# steps of the tiny test drafter (tests/conftest.py tiny_args): at most 1.0002x at --lr 6e-4,
# 1.013x at 1e-2, 1.0015x with --optimizer muon at its defaults; 1.2e10x at --lr 1e9.
EXPLODING_GROWTH = 10.0


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
        self.blown_up: str | None = None  # what an update did to the weights, once one blew them up

    def add(self, step: int, skipped_because: str | None) -> None:
        self._recent.append((step, skipped_because))
        if skipped_because is None:
            self.trained += 1
        else:
            self.skipped += 1

    def check_update(self, step: int, norm_before: float, norm_after: float) -> None:
        """The weights' norm before and after the update of `step`: not finite, or grown more than
        EXPLODING_GROWTH-fold, the run is failing from here on."""
        if not math.isfinite(norm_after) or norm_after > EXPLODING_GROWTH * norm_before:
            self.blown_up = (f"the update of step {step} took the drafter's weights from norm {norm_before:.4g} to "
                             f"{norm_after:.4g}")

    @property
    def failing(self) -> bool:
        return self.blown_up is not None or too_many_skipped([why is not None for _, why in self._recent])

    @property
    def failed_at_end(self) -> bool:
        """At the end of a run, more than half of its recent steps skipped is a verdict however
        few they were: the export would be the drafter of the steps that got through, or none."""
        return self.failing or too_many_skipped([why is not None for _, why in self._recent], min_steps=1)

    def state_dict(self) -> dict:
        """What the stop rule looks at (the counts are this run's: its closing line reports them)."""
        return {"recent": [list(entry) for entry in self._recent]}

    def load_state_dict(self, state: dict) -> None:
        self._recent.extend((int(step), why) for step, why in state["recent"])

    def summary(self) -> str:
        """Like "2 steps, skipped 8"."""
        return f"{self.trained} step{'' if self.trained == 1 else 's'}, skipped {self.skipped}"

    def error(self, lr: float, checkpoint: Path | None) -> SkippedStepsError:
        """The stop, naming the likely cause and the newest checkpoint (None: none was saved); no
        drafter is exported."""
        skipped = [(step, why) for step, why in self._recent if why is not None]
        if self.blown_up is not None:
            seen, otherwise = self.blown_up, ""
        else:
            reasons = ", ".join(f"{count} {why}" for why, count in Counter(why for _, why in skipped).items())
            seen = (f"{len(skipped)} of the last {len(self._recent)} optimizer steps were skipped ({reasons}), the "
                    f"first at step {skipped[0][0]}")
            otherwise = "; else bad data (the warnings above name the skipped steps)"
        kept = (f"The newest checkpoint is {checkpoint}" if checkpoint is not None
                else "No checkpoint was saved (one is kept every --save-every-minutes M, or --save-every N steps)")
        return SkippedStepsError(
            f"training stopped: {seen}; trained {self.summary()} in all. Likely cause: the learning rate is too high "
            f"(--lr {lr:g}): start again with a lower --lr (and --overwrite){otherwise}. No drafter was exported. "
            f"{kept}")


class UpdateCheck:
    """StepTally.check_update for every optimizer step, one step late: the weights' norm after a
    step is copied to the host without waiting (HostCopy) and read when the next step ends, long
    done by then, so the step loop never drains the GPU for it (the host prepares the next
    micro-batch while the update runs). `settle` reads and checks the pending one at once: before a
    checkpoint is saved (a blown-up update is never saved) and after the last step."""

    def __init__(self, module: torch.nn.Module, group, tally: StepTally) -> None:
        self.module, self.group, self.tally = module, group, tally
        self.norm = float(weights_norm(module, group).item())
        self._copy = HostCopy(next(module.parameters()).device)  # one norm in flight at a time
        self._pending: int | None = None  # the step whose norm is in flight

    def stepped(self, step: int) -> None:
        """Optimizer step `step` updated the weights: check the one before, start on this one."""
        self.settle()
        self._copy.start(weights_norm(self.module, self.group))
        self._pending = step

    def settle(self) -> None:
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        after = self._copy.read()[0]
        self.tally.check_update(step, self.norm, after)
        self.norm = after
