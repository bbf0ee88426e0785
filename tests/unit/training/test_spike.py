"""The spike guard: NaN/inf always skipped, spikes skipped once warm against the median of the
recent accepted losses, which follows a falling loss and ignores what was skipped."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, free_port, run_two_at_a_time
from dflash.training.spike import SpikeGuard, poisoned


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


@pytest.fixture(scope="module")
def engine_workers() -> dict[str, subprocess.CompletedProcess]:
    """Worker script -> its run in a real one-rank engine; the two go at once."""
    def run(worker: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}", "DS_ACCELERATOR": "cpu"}
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port()),
             str(REPO / "tests" / worker)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)

    workers = ("nonfinite_grad_worker.py", "grad_accum_worker.py")
    return run_two_at_a_time({worker: functools.partial(run, worker) for worker in workers})


def test_a_non_finite_gradient_or_a_poisoned_spike_is_skipped_by_the_engine(engine_workers):
    """The loss guard cannot see a NaN gradient behind a finite loss; DeepSpeed's ZeRO 1/2 step
    checks the gradient norm and skips the update. The spike guard relies on the same skip: its
    verdict, taken on the device, poisons the spike's gradient, so a spike's step moves nothing
    either, while a kept loss trains. Pinned here because the training loop relies on it (and
    counts skipped_steps)."""
    import json

    proc = engine_workers["nonfinite_grad_worker.py"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    skipped = {"loss_finite": True, "weights_moved": False, "moments_moved": False, "lr_moved": False,
               "skipped_steps": 1}
    for stage in ("1", "2"):
        assert report[stage]["nan_gradient"] == {**skipped, "guard_skipped": None}, (stage, report[stage])
        assert report[stage]["spike"] == {**skipped, "loss_finite": False, "guard_skipped": True}, (stage, report[stage])
        assert report[stage]["kept"] == {"loss_finite": True, "guard_skipped": False, "weights_moved": True,
                                         "moments_moved": True, "lr_moved": True, "skipped_steps": 0}, (
            stage, report[stage])


def test_a_poisoned_loss_is_the_loss_bit_for_bit_unless_voted_down():
    """poisoned(loss, flag): the same gradient, exactly, where the vote is 0; NaN in every
    gradient where it is 1, a non-finite loss is voted down before any warm-up."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(16, 8)

    def gradients(flag: torch.Tensor | None) -> list[torch.Tensor]:
        layer.zero_grad()
        loss = layer(x).pow(2).mean()
        (loss if flag is None else poisoned(loss, flag)).backward()
        return [p.grad.clone() for p in layer.parameters()]

    guard = SpikeGuard(factor=3.0, warmup=5)
    kept = guard.vote(torch.tensor(1.0))
    assert kept.tolist() == [0.0] and guard.settle() is False
    assert all(torch.equal(a, b) for a, b in zip(gradients(kept), gradients(None)))
    down = guard.vote(torch.tensor(float("inf")))
    assert down.tolist() == [1.0] and guard.settle() is True
    assert all(g.isnan().all() for g in gradients(down))


@pytest.mark.gpu
def test_on_a_gpu_the_vote_and_the_poisoned_backward_queue_without_a_host_sync():
    """The point of voting on the device: between the forward's loss and the engine's step, the
    host never waits for the GPU (CUDA's sync debug mode raises on any wait), and the verdicts,
    read after, are those of the CPU."""
    layer = torch.nn.Linear(64, 64).cuda()
    x = torch.randn(256, 64, device="cuda")
    guard = SpikeGuard(factor=3.0, warmup=1)
    guard.should_skip(torch.tensor(1.0, device="cuda"))  # warm: a loss above 3 is a spike
    verdicts = []
    for offset in (0.0, 100.0, float("nan")):
        layer.zero_grad()
        loss = layer(x).pow(2).mean() * 1e-3 + offset
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            poisoned(loss, guard.vote(loss)).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        verdicts.append((guard.settle(), bool(layer.weight.grad.isnan().all())))
    assert verdicts == [(False, False), (True, True), (True, True)]


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
    assert "No checkpoint was saved (one is kept every --save-every-minutes M, or --save-every N steps)" in str(
        tally.error(1e9, None))
    assert "No drafter was exported" in message


def test_one_update_that_blows_the_weights_up_stops_the_run_at_any_length():
    from dflash.training.spike import EXPLODING_GROWTH, StepTally

    tally = StepTally()
    tally.add(1, None)
    tally.check_update(1, 2.0, 2.0 * EXPLODING_GROWTH)  # as large as it may grow
    assert not tally.failing and not tally.failed_at_end
    tally.check_update(2, 2.0, 1.68e9)
    assert tally.failing, "one step, no skip: the weights alone say it"
    message = str(tally.error(1e9, None))
    assert message.startswith("training stopped: the update of step 2 took the drafter's weights from norm 2 to "
                              "1.68e+09; trained 1 step, skipped 0 in all. Likely cause: the learning rate is too "
                              "high (--lr 1e+09)"), message
    nan = StepTally()
    nan.check_update(1, 2.0, float("nan"))
    assert nan.failing


def update_check_verdicts(device: str) -> list[bool]:
    """UpdateCheck over three updates of a linear layer on `device`, the second of which blows its
    weights up: whether the tally is failing after each step, then after settle."""
    from dflash.training.spike import StepTally, UpdateCheck

    layer = torch.nn.Linear(4, 4).to(device)
    tally = StepTally()
    check = UpdateCheck(layer, None, tally)
    failing = []
    for step, factor in enumerate((1.01, 1e6, 1.01), start=1):
        with torch.no_grad():
            layer.weight.mul_(factor)
        check.stepped(step)
        failing.append(tally.failing)
    check.settle()
    failing.append(tally.failing)
    assert "the update of step 2 took" in tally.blown_up
    return failing


def test_a_blown_up_update_is_seen_by_the_end_of_the_next_step():
    assert update_check_verdicts("cpu") == [False, False, True, True]


@pytest.mark.gpu
def test_a_blown_up_update_is_seen_by_the_end_of_the_next_step_on_a_gpu():
    """The CUDA path: the norm goes to pinned host memory without waiting, read at the next step."""
    assert update_check_verdicts("cuda") == [False, False, True, True]


def test_at_the_end_of_a_run_mostly_skipped_steps_are_a_verdict_however_few():
    from dflash.training.spike import StepTally

    tally = StepTally()
    tally.add(1, None)
    tally.add(2, "with a loss not finite or a spike")
    assert not tally.failing and not tally.failed_at_end, "half is not more than half"
    tally.add(3, "with a gradient norm not finite")
    assert not tally.failing, "three steps are no verdict while the run goes on"
    assert tally.failed_at_end, "but they are all the run has to show"


def test_a_restored_guard_and_tally_decide_as_the_uninterrupted_ones():
    """A checkpoint (JSON) taken with a skip inside the window: the restored guard skips the same
    micro-batches after it; one that starts afresh warms up again and lets the spikes through."""
    import json

    from dflash.training.spike import StepTally

    before, after = [2.0] * 6 + [9.0] + [2.1] * 3, [7.0, 2.0, 6.9, 2.2]
    straight = SpikeGuard(factor=3.0, warmup=5, window=8)
    assert feed(straight, before) == [False] * 6 + [True] + [False] * 3
    saved = json.loads(json.dumps(straight.state_dict()))
    expected = feed(straight, after)
    restored = SpikeGuard(factor=3.0, warmup=5, window=8)
    restored.load_state_dict(saved)
    assert feed(restored, after) == expected == [True, False, True, False]
    assert (restored.reference, restored.accepted, restored.skipped) == (
        straight.reference, straight.accepted, straight.skipped)
    assert feed(SpikeGuard(factor=3.0, warmup=5, window=8), after) != expected

    tally = StepTally()
    for step, why in [(1, None), (2, "with a loss not finite or a spike"), (3, "with a loss not finite or a spike")]:
        tally.add(step, why)
    resumed = StepTally()
    resumed.load_state_dict(json.loads(json.dumps(tally.state_dict())))
    tally.add(4, None)
    resumed.add(4, None)
    tally.add(5, "with a gradient norm not finite")
    resumed.add(5, "with a gradient norm not finite")
    assert tally.failing and resumed.failing, "3 of the last 5 skipped, 2 of them before the checkpoint"
    assert resumed.summary() == "1 step, skipped 1", "the counts are the resumed run's own"


def test_the_kept_gradient_scale_leaves_skipped_micro_batches_out_of_the_mean():
    from dflash.drafter.objective import LossTerms, kept_gradient_scale

    per_micro = torch.tensor([[4.0, 6.0], [1.0, 4.0], [1.0, 2.0]], dtype=torch.float64)  # weight, positions
    assert kept_gradient_scale(per_micro, [False] * 3, LossTerms("ce"), 0.0) == 1.0
    assert kept_gradient_scale(per_micro, [False, True, False], LossTerms("ce"), 0.0) == 6.0 / 5.0
    assert kept_gradient_scale(per_micro, [False, True, False], LossTerms("dpace"), 0.0) == 12.0 / 8.0
    assert kept_gradient_scale(per_micro, [False, True, False], LossTerms("dpace"), 0.5) is None, (
        "D-PACE over positions, KL over weights: no one factor")
    assert kept_gradient_scale(per_micro, [False, True, False], LossTerms("ce+dpace"), 0.0) is None
    assert kept_gradient_scale(per_micro, [False, False, True], LossTerms("ce+dpace"), 0.0) == 1.2, (
        "a skip that changed both sums alike")
    assert kept_gradient_scale(per_micro, [True] * 3, LossTerms("ce"), 0.0) is None, "nothing kept"


def test_a_step_with_skipped_micro_batches_takes_the_gradient_of_the_kept_ones_only(engine_workers):
    """Three micro-batches accumulated in a real engine (ZeRO 1 and 2), one or none skipped: the
    gradient the optimizer is handed, and the engine's gradient norm, are those of the mean over
    the kept micro-batches (plain autograd, float32). Where no factor gives that mean (nothing kept,
    or a loss over both normalisers changed unequally), the engine skips the step."""
    import json

    proc = engine_workers["grad_accum_worker.py"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(records) == 6
    for record in records:
        whole_skip = all(record["skipped"]) or record["kind"] == "ce+dpace"
        assert record["applied"] is not whole_skip and record["skipped_steps"] == int(whole_skip), record
        if not whole_skip:
            assert record["relative_error"] < 1e-5, record  # the denominators of all three: 0.2 to 0.9 off
            assert record["norm"] == pytest.approx(record["want_norm"], rel=1e-5), record


def test_the_weights_norm_is_the_float32_norm_of_every_weight_whatever_its_dtype():
    from dflash.training.spike import weights_norm

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8).to(torch.bfloat16))
    flat = torch.cat([p.detach().double().flatten() for p in module.parameters()])
    norm = weights_norm(module)
    assert norm.shape == (1,) and norm.dtype == torch.float32
    assert float(norm) == pytest.approx(float(flat.norm()), rel=1e-6)
