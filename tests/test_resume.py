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

from conftest import run_trainer, start_ranks
from dflash.checkpoint import STATE_FILE, latest_checkpoint
from test_multiprocess import tiny_args

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
    (1, ["--target-ranks", "colocated"], 0),
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
    proc = run_trainer([*args(resumed), "--resume"], nproc=world if world > 1 else 0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"step_{start} at step {start}" in proc.stderr
    expected, got = losses_by_step(straight), losses_by_step(resumed)
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    for step in range(start + 1, STEPS + 1):
        assert got[step] == expected[step], (step, got[step], expected[step])
    assert (resumed / "checkpoints" / f"step_{STEPS}" / STATE_FILE).is_file()
