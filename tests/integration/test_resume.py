"""A run killed (SIGKILL, no warning) after a checkpoint resumes exactly: the resumed steps have
the same losses as an uninterrupted run, in colocated and split placements, and a half-written
checkpoint is never picked."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import run_trainer, start_ranks, tiny_args
from dflash.checkpoint import STATE_FILE, latest_checkpoint

STEPS = 12


def losses_by_step(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}  # a resumed step overwrites the crashed run's


def kill_after_first_checkpoint(procs: list[subprocess.Popen], victim: int, out: Path) -> None:
    deadline = time.monotonic() + 240
    while latest_checkpoint(out) is None:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no checkpoint was written"
        time.sleep(0.02)
    procs[victim].send_signal(signal.SIGKILL)
    time.sleep(0.5)
    for p in procs:  # what a launcher does once one rank died
        p.kill()
        p.wait()


@pytest.mark.parametrize("world, placement, victim", [
    (1, ["--target-ranks", "colocated", "--max-draft-positions", "64"], 0),  # the resume omits the budget
    (2, ["--target-ranks", "1"], 0),  # the only drafter rank
    (3, ["--target-ranks", "1", "--deepspeed-config", "ds_configs/zero2.json"], 1),  # one of two drafters
], ids=["colocated-x1", "split-1+1", "split-1+2-zero2"])
def test_sigkill_and_resume_reproduces_the_uninterrupted_run(tiny_setup, tmp_path, world, placement, victim):
    def args(out: Path) -> list[str]:
        a = tiny_args(tiny_setup, out, *placement, "--feature-noise-std", "0.1", "--save-every", "3")
        a[a.index("--max-steps") + 1] = str(STEPS)
        return a

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    proc = run_trainer(args(straight), nproc=world if world > 1 else 0)
    assert proc.returncode == 0, proc.stderr[-3000:]

    kill_after_first_checkpoint(start_ranks(args(resumed), world), victim, resumed)
    assert not (resumed / "drafter").exists(), "the run finished before it was killed"
    start = int(latest_checkpoint(resumed).name.removeprefix("step_"))
    (resumed / "checkpoints" / f"step_{STEPS + 3}").mkdir()  # a save cut off by a crash: no trainer_state.json
    resume_args = args(resumed)
    if "--max-draft-positions" in resume_args:  # planned as the checkpoint was, whatever the memory now
        at = resume_args.index("--max-draft-positions")
        del resume_args[at:at + 2]
    proc = run_trainer([*resume_args, "--resume"], nproc=world if world > 1 else 0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"step_{start} at step {start}" in proc.stderr
    expected, got = losses_by_step(straight), losses_by_step(resumed)
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    for step in range(start + 1, STEPS + 1):
        assert got[step] == expected[step], (step, got[step], expected[step])
    assert (resumed / "checkpoints" / f"step_{STEPS}" / STATE_FILE).is_file()


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)], ids=["2-to-1", "1-to-2"])
def test_resume_on_another_number_of_drafter_ranks(tmp_path, before, after):
    """A node lost or added: the ZeRO-sharded state is resharded through DeepSpeed's universal
    layout, the epoch continues over the samples not yet used (tests/unit/test_sampler.py pins that
    exactly), the learning rate stays on its curve and the loss goes on without a jump. On the
    demo target and data, which a drafter learns quickly (random data would not show a jump)."""
    import torch

    from dflash.schedules import LRSchedule

    steps, out = 24, tmp_path / "run"
    args = ["--output-dir", str(out), "--max-steps", str(steps), "--save-every", "12", "--log-every", "1",
            "--eval-prompts", "0", "--report-to", "none", "--target-ranks", "colocated"]
    kill_after_first_checkpoint(start_ranks(args, before), 0, out)
    checkpoint = latest_checkpoint(out)
    start = int(checkpoint.name.removeprefix("step_"))
    proc = run_trainer([*args, "--resume"], nproc=after if after > 1 else 0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"checkpoint of {before} drafter ranks resharded onto {after}" in proc.stderr
    assert f"on {after} ranks instead of {before}" in proc.stderr

    records = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert sorted(records) == list(range(1, steps + 1))
    assert records[steps]["drafter_ranks"] == after
    schedule = LRSchedule(steps, 0.04)  # --max-steps fixes the curve whatever the rank count
    for step, record in records.items():
        assert record["lr"] == pytest.approx(6e-4 * schedule(step), rel=1e-9), step
    # the trained state came along: the steps after the resume keep the progress made before it
    first, last_before = records[1]["loss"], records[start]["loss"]
    after_resume = [records[step]["loss"] for step in range(start + 1, start + 4)]
    assert first - last_before > 2.0, "the run must have learned before the kill"
    assert max(after_resume) < last_before + 0.2 * (first - last_before), (first, last_before, after_resume)
    # the universal copy holds exactly the weights the sharded checkpoint saved
    universal = checkpoint.parent / ".universal" / checkpoint.name
    saved = torch.load(checkpoint / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    for name, weight in saved.items():
        full = torch.load(universal / "zero" / name / "fp32.pt", weights_only=False)
        full = full["param"] if isinstance(full, dict) else full
        assert torch.equal(full.to(weight.dtype).reshape(weight.shape), weight), name


def test_a_resume_with_another_recipe_is_refused_before_training(tiny_setup, tmp_path):
    """A changed loss, learning rate or length on --resume would train another objective, or be
    overruled by the checkpoint's scheduler state, without a word: each is named, nothing trains."""
    out = tmp_path / "run"
    proc = run_trainer(tiny_args(tiny_setup, out, "--loss", "ce", "--save-every", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    newest = latest_checkpoint(out)
    metrics = (out / "metrics.jsonl").read_text()
    proc = run_trainer([*tiny_args(tiny_setup, out, "--lr", "1e-3", "--max-steps", "20"), "--resume"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"--resume from {newest}: --loss 'dpace' (the checkpoint: 'ce'); --lr 0.001 (the checkpoint: 0.0006); "
            "--max-steps 20 (the checkpoint: 8)") in proc.stderr
    assert "--overwrite instead of --resume" in proc.stderr
    assert (out / "metrics.jsonl").read_text() == metrics and latest_checkpoint(out) == newest
