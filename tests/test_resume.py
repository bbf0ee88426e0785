"""A run killed after a checkpoint resumes exactly: the resumed steps have the same losses as
an uninterrupted run, and a half-written checkpoint is never picked."""

from __future__ import annotations

import json
import os
from pathlib import Path

from conftest import run_trainer
from dflash.checkpoint import STATE_FILE, latest_checkpoint
from test_multiprocess import tiny_args


def losses_by_step(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}  # a resumed step overwrites the crashed run's


def test_crash_and_resume_reproduces_the_uninterrupted_run(tiny_setup, tmp_path):
    straight = tmp_path / "straight"
    proc = run_trainer(tiny_args(tiny_setup, straight, "--feature-noise-std", "0.1"))
    assert proc.returncode == 0, proc.stderr[-3000:]

    resumed = tmp_path / "resumed"
    args = tiny_args(tiny_setup, resumed, "--feature-noise-std", "0.1", "--save-every", "3")
    crash = run_trainer(args, env={**os.environ, "DFLASH_CRASH_AFTER_STEP": "5"})
    assert crash.returncode == 17
    assert latest_checkpoint(resumed).name == "step_3"
    (resumed / "checkpoints" / "step_9").mkdir()  # a save cut off by a crash: no trainer_state.json
    proc = run_trainer([*args, "--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "step_3 at step 3" in proc.stderr
    expected, got = losses_by_step(straight), losses_by_step(resumed)
    assert sorted(got) == sorted(expected)
    for step in range(4, 9):
        assert got[step] == expected[step], (step, got[step], expected[step])
    assert (resumed / "checkpoints" / "step_6" / STATE_FILE).is_file()
