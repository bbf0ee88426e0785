"""Asynchronous checkpoints: a full disk is reported with the path and leaves the previous
checkpoint intact, a kill mid-save leaves the previous one usable, non-finite weights are never
committed, old checkpoints are pruned; exports replace the old folder only when complete."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, free_port, tiny_drafter, tiny_target
from dflash.training.checkpoint import STATE_FILE, checkpoint_dir, latest_checkpoint


def start_worker(faults: str, root: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}", "DS_ACCELERATOR": "cpu"}
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port()),
         str(REPO / "tests" / "checkpoint_worker.py"), faults, str(root)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> tuple[Path, dict[str, list[str]]]:
    """Four saves under each fault, in one worker process: root, fault -> outcomes."""
    root = tmp_path_factory.mktemp("saves")
    proc = start_worker("disk-full,nan,none", root)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    outcomes: dict[str, list[str]] = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            outcomes.setdefault(record["fault"], []).append(record["outcome"])
    return root, outcomes


def steps_on_disk(out: Path) -> list[str]:
    return sorted(p.name for p in checkpoint_dir(out).iterdir() if (p / STATE_FILE).is_file())


def test_disk_full_names_the_path_and_keeps_the_previous_checkpoint(saves):
    root, outcomes = saves
    out, got = root / "disk-full", outcomes["disk-full"]
    assert got[0] == "saved" and got[2:] == ["saved", "saved"]
    assert got[1].startswith("error: disk full while writing ") and ".step_2.tmp" in got[1]
    assert f"the newest complete checkpoint ({checkpoint_dir(out) / 'step_1'}) is intact" in got[1]
    assert steps_on_disk(out) == ["step_1", "step_3", "step_4"]


def test_non_finite_weights_are_never_committed(saves):
    root, outcomes = saves
    assert outcomes["nan"][:2] == ["saved", "saved"]
    assert steps_on_disk(root / "nan") == ["step_1", "step_2"]  # steps 3 and 4 had NaN weights


def test_only_the_newest_checkpoints_are_kept(saves):
    root, outcomes = saves
    assert outcomes["none"] == ["saved"] * 4
    assert steps_on_disk(root / "none") == ["step_3", "step_4"]


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_usable(tmp_path):
    proc = start_worker("slow", tmp_path)
    out = tmp_path / "slow"
    try:
        deadline = time.monotonic() + 240
        while not (checkpoint_dir(out) / ".step_2.tmp").exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        proc.kill()
    assert latest_checkpoint(out).name == "step_1"
    state = torch.load(latest_checkpoint(out) / "mp_rank_00_model_states.pt", weights_only=False)
    assert "module" in state and json.loads((latest_checkpoint(out) / STATE_FILE).read_text()) == {"step": 1}


def test_export_on_a_full_disk_keeps_the_earlier_export(tmp_path, monkeypatch):
    from dflash.drafter import export
    from dflash.util.files import StorageError

    drafter = tiny_drafter(tiny_target("qwen3", dtype=torch.float32)).float()
    out = export.export_drafter(drafter, tmp_path / "drafter")
    before = (out / export.WEIGHTS_NAME).read_bytes()
    assert oct(out.stat().st_mode & 0o777) != oct(0o700)  # readable by serving engines run as others

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export, "save_file", full)
    with pytest.raises(StorageError, match=f"disk full while writing {out}.*the earlier {out} .* is intact"):
        export.export_drafter(drafter, out)
    assert (out / export.WEIGHTS_NAME).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]  # no staging folder left behind


def test_a_save_is_due_by_steps_or_by_minutes_whichever_is_set():
    from dflash.training.checkpoint import save_due

    assert save_due(10, every=5, minutes=0.0, seconds_since_save=0.0)
    assert not save_due(11, every=5, minutes=0.0, seconds_since_save=1e9), "no time set: steps alone"
    assert save_due(11, every=0, minutes=30.0, seconds_since_save=1800.0)
    assert not save_due(11, every=0, minutes=30.0, seconds_since_save=1799.0)
    assert save_due(11, every=5, minutes=30.0, seconds_since_save=1800.0), "both set: whichever comes first"
    assert not save_due(10, every=0, minutes=0.0, seconds_since_save=1e9), "--save-every 0: never"


def test_drafter_ranks_agree_on_a_time_based_save_whichever_clock_passed():
    """Each rank's clock says whether the minute has passed; their verdicts are all-reduced, so a
    rank whose clock runs ahead does not wait at a save the others skip."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(REPO / "tests" / "checkpoint_clock_worker.py")], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdicts = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("[")))
    assert verdicts == [[False, True]] * 2, "rank 0's clock alone (50 s) would not have saved at the second step"


def test_a_run_saves_by_the_clock_and_keeps_the_newest_n(tiny_setup, tmp_path):
    """--save-every-minutes with a tiny interval saves after every step of a real run, and
    --keep-checkpoints 2 leaves the newest two, each complete."""
    from conftest import run_trainer, tiny_args

    proc = run_trainer(tiny_args(tiny_setup, tmp_path, "--save-every-minutes", "0.0001", "--keep-checkpoints", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    saves = [line for line in proc.stderr.splitlines() if "checkpoint " in line and line.endswith(" saved")]
    assert len(saves) == 8, proc.stderr[-3000:]  # each step takes longer than 6 ms
    assert steps_on_disk(tmp_path) == ["step_7", "step_8"]
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path) / "step_8"
