"""The spike guard: NaN/inf always skipped, spikes skipped once the running mean is warm,
skipped micro-batches never move the mean."""

from __future__ import annotations

import pytest
import torch

from dflash.spike import SpikeGuard


def feed(guard: SpikeGuard, values: list[float]) -> list[bool]:
    return [guard.should_skip(torch.tensor(v)) for v in values]


def test_non_finite_losses_are_always_skipped():
    guard = SpikeGuard(factor=3.0, warmup=5)
    assert feed(guard, [float("nan"), 2.0, float("inf"), 2.0]) == [True, False, True, False]
    assert guard.skipped == 2 and guard.accepted == 2


def test_spikes_are_skipped_only_after_warmup_and_do_not_move_the_mean():
    guard = SpikeGuard(factor=3.0, warmup=5, decay=0.5)
    assert feed(guard, [2.0, 100.0]) == [False, False]  # still warming up: accepted
    guard = SpikeGuard(factor=3.0, warmup=5, decay=0.5)
    assert feed(guard, [2.0] * 5) == [False] * 5
    assert feed(guard, [6.5, 5.9]) == [True, False]  # 6.5 > 3 x 2.0; 5.9 is not
    assert guard.mean == pytest.approx(0.5 * 2.0 + 0.5 * 5.9), "the skipped 6.5 must not enter the mean"


def test_factor_zero_only_guards_against_nan():
    guard = SpikeGuard(factor=0.0, warmup=0)
    assert feed(guard, [1.0, 1000.0, float("nan")]) == [False, False, True]


def test_ranks_without_samples_vote_without_moving_the_mean():
    guard = SpikeGuard(factor=3.0, warmup=1, decay=0.5)
    feed(guard, [4.0])
    assert guard.should_skip(torch.tensor(0.0), track=False) is False
    assert guard.mean == 4.0 and guard.accepted == 1
