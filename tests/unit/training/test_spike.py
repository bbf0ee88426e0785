"""The spike guard: NaN/inf always skipped, spikes skipped once warm against the median of the
recent accepted losses, which follows a falling loss and ignores what was skipped."""

from __future__ import annotations

import torch

from dflash.training.spike import SpikeGuard


def feed(guard: SpikeGuard, values: list[float]) -> list[bool]:
    return [guard.should_skip(torch.tensor(v)) for v in values]


def test_non_finite_losses_are_always_skipped():
    guard = SpikeGuard(factor=3.0, warmup=5)
    assert feed(guard, [float("nan"), 2.0, float("inf"), 2.0]) == [True, False, True, False]
    assert guard.skipped == 2 and guard.accepted == 2


def test_spikes_are_skipped_only_after_warmup_and_do_not_enter_the_window():
    guard = SpikeGuard(factor=3.0, warmup=5, window=4)
    assert feed(guard, [2.0, 100.0]) == [False, False]  # still warming up: accepted
    guard = SpikeGuard(factor=3.0, warmup=5, window=4)
    assert feed(guard, [2.0] * 5) == [False] * 5
    assert feed(guard, [6.5, 5.9]) == [True, False]  # 6.5 > 3 x 2.0; 5.9 is not
    assert guard.reference == 2.0, "the median of [2, 2, 2, 5.9]; the skipped 6.5 is not in it"


def test_the_reference_follows_a_falling_loss_where_a_running_mean_would_lag():
    """A run whose loss falls from 30 to 4.5 in 30 steps: a 6x spike at step 40 is caught.
    (A mean with decay 0.98 over the same losses was still about 20 there: the spike, 27,
    would have passed.)"""
    guard = SpikeGuard(factor=3.0, warmup=20, window=20)
    falling = [30 - 25.5 * min(i, 30) / 30 for i in range(40)]
    assert not any(feed(guard, falling))
    assert feed(guard, [27.0]) == [True]


def test_factor_zero_only_guards_against_nan():
    guard = SpikeGuard(factor=0.0, warmup=0)
    assert feed(guard, [1.0, 1000.0, float("nan")]) == [False, False, True]


def test_ranks_without_samples_vote_without_moving_the_reference():
    guard = SpikeGuard(factor=3.0, warmup=1)
    feed(guard, [4.0])
    assert guard.should_skip(torch.tensor(0.0), track=False) is False
    assert guard.reference == 4.0 and guard.accepted == 1


def test_a_non_finite_gradient_behind_a_finite_loss_is_skipped_by_the_engine():
    """The loss guard cannot see it; DeepSpeed's ZeRO 1/2 step checks the gradient norm and skips
    the update. Pinned here because the training loop relies on it (and counts skipped_steps)."""
    import json
    import os
    import subprocess
    import sys

    from conftest import REPO, free_port

    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port()),
         str(REPO / "tests" / "nonfinite_grad_worker.py")], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for stage in ("1", "2"):
        assert report[stage] == {"loss_finite": True, "weights_moved": False, "moments_moved": False,
                                 "lr_moved": False, "skipped_steps": 1}, (stage, report[stage])


def test_a_run_stops_once_more_than_half_of_its_recent_steps_were_skipped():
    from dflash.training.spike import too_many_skipped

    assert not too_many_skipped([True] * 3), "three steps are no verdict"
    assert not too_many_skipped([False, False, True, True]), "half is not more than half"
    assert too_many_skipped([False, True, True, True])
    assert too_many_skipped([False, False, True, True, True])
    assert not too_many_skipped([True] * 10 + [False] * 20), "only the last 20 steps count"
    assert too_many_skipped([False] * 100 + [True] * 11)
    assert not too_many_skipped([False] * 100 + [True] * 10)


def test_the_tally_counts_trained_and_skipped_steps_and_names_the_cause():
    from pathlib import Path

    from dflash.training.spike import StepTally

    tally = StepTally()
    tally.add(1, None)
    tally.add(2, "with a loss not finite or a spike")
    tally.add(2, "with a loss not finite or a spike")
    assert not tally.failing and tally.summary() == "1 step, skipped 2"
    tally.add(3, "with a gradient norm not finite")
    assert tally.failing
    message = str(tally.error(1e9, Path("runs/x/checkpoints/step_1")))
    assert message.startswith("training stopped: 3 of the last 4 optimizer steps were skipped (2 with a loss not "
                              "finite or a spike, 1 with a gradient norm not finite), the first at step 2; trained "
                              "1 step, skipped 3 in all."), message
    assert "(--lr 1e+09): start again with a lower --lr (and --overwrite); else bad data" in message
    assert message.endswith("The newest checkpoint is runs/x/checkpoints/step_1")
    assert "No checkpoint was saved (--save-every N" in str(tally.error(1e9, None))
