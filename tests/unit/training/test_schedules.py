"""The step-driven schedules: learning rate (warmup, cosine, rebase on a resume onto other
ranks), the run's planned length, the feature noise."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from dflash.training.schedules import ADAM_BETAS, LRSchedule, feature_noise_std, planned_total_steps


def test_lr_warms_up_linearly_then_decays_by_cosine_to_zero():
    schedule = LRSchedule(total_steps=100, warmup_ratio=0.1, kind="cosine")
    assert schedule.warmup == 10
    assert [schedule(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert schedule(10) == pytest.approx(1.0)
    assert schedule(55) == pytest.approx(0.5)  # half way through the decay
    assert schedule(100) == pytest.approx(0.0, abs=1e-12) and schedule(150) == pytest.approx(0.0, abs=1e-12)
    decay = [schedule(s) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert schedule.last_step() == 100


def test_rebase_continues_the_curve_and_ends_at_the_new_total():
    schedule = LRSchedule(total_steps=100, warmup_ratio=0.1, kind="cosine")
    here = schedule(40)
    schedule.rebase(40, 70)  # 60 steps were left, now 30 are: the same curve, walked twice as fast
    assert schedule(40) == pytest.approx(here)
    assert schedule(55) == pytest.approx(LRSchedule(100, 0.1, "cosine")(70))
    assert schedule.last_step() == 70 and schedule(70) == pytest.approx(0.0, abs=1e-12)
    schedule.rebase(55, 70)  # the same total leaves the curve as it is
    assert schedule(60) == pytest.approx(LRSchedule(100, 0.1, "cosine")(80))


def test_the_lr_rises_no_faster_than_the_minimum_warmup_whatever_the_ratio():
    """4% of a 150-step run is 6 steps: the curve would reach the peak at step 6, and a drafter
    stepped at the peak before AdamW's second moments settle can collapse."""
    from dflash.config import TrainArgs

    assert TrainArgs.min_warmup_steps == round(2 / (1 - ADAM_BETAS[1])) == 40
    short = LRSchedule(total_steps=150, warmup_ratio=0.04, kind="wsd", min_warmup=40)
    assert [short(s) for s in (0, 9, 19, 39)] == pytest.approx([1 / 40, 10 / 40, 20 / 40, 1.0])
    assert short(40) == 1.0 and short.warming_up(39) and not short.warming_up(40)
    # a long run's own warmup is longer than the minimum: its curve is left as it is
    long = LRSchedule(total_steps=10_000, warmup_ratio=0.04, kind="wsd", min_warmup=40)
    assert [long(s) for s in (0, 39, 399)] == pytest.approx([1 / 400, 40 / 400, 1.0])
    # a run too short for it warms up over its first half
    assert LRSchedule(total_steps=10, warmup_ratio=0.04, kind="wsd", min_warmup=40).min_warmup == 5


def test_a_max_minutes_first_estimate_cannot_squeeze_the_warmup_into_a_few_steps():
    """--max-minutes: the curve of the cap (100,000 steps) until the first estimate at step 13,
    then the rest of it spread over 150 steps: its warmup passes in 5 steps (the GPU run that
    collapsed), the learning rate in 40."""
    schedule = LRSchedule(total_steps=100_000, warmup_ratio=0.04, kind="wsd", min_warmup=40)
    schedule.rebase(13, 150)
    lrs = [schedule(s) for s in range(150)]
    assert all(lr <= (s + 1) / 40 + 1e-12 for s, lr in enumerate(lrs))
    assert lrs[39] == pytest.approx(1.0) and lrs[30] < 0.8


def run_config(epochs: int, max_steps: int = 0):
    return SimpleNamespace(train=SimpleNamespace(epochs=epochs, max_steps=max_steps))


def test_planned_total_steps():
    assert planned_total_steps(run_config(3), 50) == 150
    assert planned_total_steps(run_config(3, max_steps=70), 50) == 70
    # resumed in epoch 1 (of 0..2) after 60 steps, with 25 steps left in that epoch as replanned
    assert planned_total_steps(run_config(3), 50, done=60, epoch=1, rest_of_epoch=25) == 60 + 25 + 50


def test_feature_noise_decays_by_cosine_to_zero():
    assert feature_noise_std(0, 100, 0.1) == 0.1
    assert feature_noise_std(50, 100, 0.1) == pytest.approx(0.05)
    assert feature_noise_std(100, 100, 0.1) == 0.0 and feature_noise_std(200, 100, 0.1) == 0.0
    assert feature_noise_std(10, 100, 0.0) == 0.0
    assert math.isclose(feature_noise_std(25, 100, 0.2), 0.1 * (1 + math.cos(math.pi / 4)))


def test_wsd_holds_the_peak_then_decays_linearly_over_the_last_share():
    schedule = LRSchedule(total_steps=100, warmup_ratio=0.1, kind="wsd", decay_ratio=0.2)
    assert [schedule(s) for s in (0, 9)] == pytest.approx([0.1, 1.0])
    assert all(schedule(s) == 1.0 for s in range(10, 81))
    assert [schedule(s) for s in (85, 90, 100)] == pytest.approx([0.75, 0.5, 0.0])
    schedule.rebase(90, 120)  # a resume onto other ranks stretches the decay left
    assert schedule(90) == pytest.approx(0.5) and schedule(105) == pytest.approx(0.25)


def test_runs_decay_by_wsd_unless_told_otherwise(tmp_path):
    """WSD beat cosine on every seed on the demo target and on SmolLM2 (BENCHMARKS.md), so the
    demo and a user's own target both decay by it; the flag brings cosine back."""
    from dflash.config import parse_config

    (tmp_path / "chats.jsonl").write_text("")
    own = ["--target", str(tmp_path), "--train-data", str(tmp_path / "chats.jsonl")]
    assert parse_config([], for_training=False).train.lr_schedule == "wsd"
    assert parse_config(own, for_training=False).train.lr_schedule == "wsd"
    assert parse_config([*own, "--lr-schedule", "cosine"], for_training=False).train.lr_schedule == "cosine"
    assert parse_config(["--lr-schedule", "cosine"], for_training=False).train.lr_schedule == "cosine"
