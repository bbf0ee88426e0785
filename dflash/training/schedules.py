"""What changes with the optimizer step: the learning rate, the feature noise, and the run's
length in steps that both are spread over."""

from __future__ import annotations

import math

from dflash.config import RunConfig

# AdamW's betas. Its second-moment estimate averages the squared gradients of about 1/(1 - beta2)
# steps; before it has, its per-weight step sizes are noisy, and a drafter stepped at the peak
# learning rate then can collapse onto the most frequent tokens (on Qwen2.5-Coder-0.5B: BENCHMARKS.md
# "A collapsed drafter"). Hence --min-warmup-steps 40 = 2 / (1 - beta2), the untuned warmup rule
# (Ma & Yarats, "On the adequacy of untuned warmup for adaptive optimization", 2021).
ADAM_BETAS = (0.9, 0.95)


class LRSchedule:
    """Linear warmup over warmup_ratio of the steps, then (a LambdaLR factor) `cosine`: cosine
    decay to 0; `wsd`: stable at 1, then linear decay to 0 over the last decay_ratio of the steps.
    Whatever the ratio, the factor rises no faster than a linear warmup over `min_warmup` steps
    (--min-warmup-steps, at most half the run): 4% of a short run, or of the rest of the curve
    spread over a --max-minutes run's first estimate, is a handful of steps.

    A callable object, so LambdaLR's state_dict (and so every checkpoint) carries it. A resume
    onto another number of drafter ranks changes how many steps are left; `rebase` spreads them
    over the rest of the same curve, so the learning rate continues where it was.
    """

    def __init__(self, total_steps: int, warmup_ratio: float, kind: str, decay_ratio: float = 0.2,
                 min_warmup: int = 0):
        self.total_steps, self.kind = total_steps, kind
        self.warmup = max(1, int(round(total_steps * warmup_ratio)))
        self.min_warmup = min(min_warmup, total_steps // 2)  # in steps, not curve positions: rebase leaves it
        self.decay = max(1, int(round(total_steps * decay_ratio)))
        self.base_step, self.base_position, self.scale = 0, 0.0, 1.0  # step -> position on the curve

    def position(self, step: int) -> float:
        return self.base_position + (step - self.base_step) * self.scale

    def warming_up(self, step: int) -> bool:
        return step < self.min_warmup or self.position(step) < self.warmup

    def __call__(self, step: int) -> float:
        factor = self._curve(self.position(step))
        return min(factor, (step + 1) / self.min_warmup) if step < self.min_warmup else factor

    def _curve(self, at: float) -> float:
        if at < self.warmup:
            return (at + 1) / self.warmup
        if self.kind == "wsd":
            return min(1.0, max(0.0, (self.total_steps - at) / self.decay))
        progress = (at - self.warmup) / max(1, self.total_steps - self.warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    def last_step(self) -> int:
        """The step at which the curve reaches its end (the run's total)."""
        return int(round(self.base_step + (self.total_steps - self.base_position) / self.scale))

    def rebase(self, step: int, total_steps: int) -> None:
        """From `step` on, the run has `total_steps` in all; the same total leaves the curve as is."""
        at = self.position(step)
        self.base_step, self.base_position = step, at
        self.scale = (self.total_steps - at) / (total_steps - step) if total_steps > step else 1.0


def planned_total_steps(config: RunConfig, steps_per_epoch: int, done: int = 0, epoch: int = 0,
                        rest_of_epoch: int | None = None) -> int:
    """Optimizer steps of the whole run: `done`, the rest of `epoch`, then whole epochs."""
    rest = steps_per_epoch if rest_of_epoch is None else rest_of_epoch
    total = done + rest + steps_per_epoch * (config.train.epochs - epoch - 1)
    return min(total, config.train.max_steps) if config.train.max_steps > 0 else total


def feature_noise_std(step: int, total_steps: int, start_std: float) -> float:
    """Gaussian feature-noise std: cosine decay from `start_std` to 0 over the run."""
    if start_std <= 0 or total_steps <= 0:
        return 0.0
    progress = min(step / total_steps, 1.0)
    return start_std * 0.5 * (1.0 + math.cos(math.pi * progress))
