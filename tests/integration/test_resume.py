"""A run killed (SIGKILL, no warning) after a checkpoint resumes exactly: the resumed steps have
the same losses as an uninterrupted run, in colocated and split placements, metrics.jsonl holds
each step once, and a half-written or later damaged checkpoint is never picked. Ctrl-C ends a run
with one line that names the checkpoint to resume from."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import BackgroundTrainer, run_trainer, start_ranks, tiny_args
from dflash.training.checkpoint import STATE_FILE, CheckpointError, latest_checkpoint

STEPS = 12


def losses_by_step(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)), f"a step logged twice or out of order: {steps}"
    return {r["step"]: r["loss"] for r in records}


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


@pytest.mark.parametrize("world, placement, victim, expect", [
    # the resume omits the budget; with echo, it starts at an echo whose first step ran before the kill
    (1, ["--target-ranks", "colocated", "--max-draft-positions", "64", "--reuse-features", "2"], 0,
     "colocated: target and drafter on all 1 ranks"),
    (2, ["--target-ranks", "1"], 0, "split: target on ranks [1], drafter on ranks [0]"),  # the only drafter rank
    (3, ["--target-ranks", "1", "--deepspeed-config", "ds_configs/zero2.json"], 1,  # one of two drafters
     "split: target on ranks [2], drafter on ranks [0, 1]"),
], ids=["colocated-x1", "split-1+1", "split-1+2-zero2"])
def test_sigkill_and_resume_reproduces_the_uninterrupted_run(tiny_setup, tmp_path, world, placement, victim, expect):
    def args(out: Path) -> list[str]:
        a = tiny_args(tiny_setup, out, *placement, "--feature-noise-std", "0.1", "--save-every", "3")
        a[a.index("--max-steps") + 1] = str(STEPS)
        return a

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    # one process: the uninterrupted run goes on alongside the one that is killed (a one-process
    # start-up leaves a core idle); its losses do not depend on what else runs. More ranks than
    # cores would only slow both down, so the multi-rank runs go one after the other
    uninterrupted = BackgroundTrainer(args(straight), tmp_path / "straight.err", nproc=world if world > 1 else 0)
    if world > 1:
        proc = uninterrupted.result()
        assert proc.returncode == 0, proc.stderr[-3000:]
    try:
        kill_after_first_checkpoint(start_ranks(args(resumed), world), victim, resumed)
    finally:
        proc = uninterrupted.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the uninterrupted run is also the placement's plain training run: placed as asked, exported
    assert expect in proc.stderr and (straight / "drafter" / "model.safetensors").is_file()
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
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1)) and all(loss > 0 for loss in expected.values())
    for step in range(start + 1, STEPS + 1):
        assert got[step] == expected[step], (step, got[step], expected[step])
    assert (resumed / "checkpoints" / f"step_{STEPS}" / STATE_FILE).is_file()


def spiky_run(tiny_setup, out: Path, steps: int, *extra: str):
    """A tiny run whose spike factor of 1.002 makes a few of its losses spikes: at the peak learning
    rate from step 2 (no 20-step warmup) they wobble enough. Its flags, process and metrics records."""
    args = tiny_args(tiny_setup, out, "--spike-factor", "1.002", "--min-warmup-steps", "0", *extra)
    args[args.index("--max-steps") + 1] = str(steps)
    proc = run_trainer(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return args, proc, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_resumed_run_skips_exactly_as_the_uninterrupted_one(tiny_setup, tmp_path):
    """The spike guard's window is in the checkpoint: a run resumed from step 25, with a skip
    before it inside the window, skips the same micro-batches after it and trains the same losses.
    (A guard that started afresh would warm up again for 20 steps and let every spike through.)
    The tiny run's losses differ by under 1% from step to step, so a spike factor of 1.002 makes
    a few of them spikes."""
    import shutil

    args, _, straight = spiky_run(tiny_setup, tmp_path / "straight", 40, "--save-every", "25")
    skips = {r["step"]: r["skipped_micro_batches"] for r in straight}
    assert skips[25] >= 1 and skips[40] > skips[25], f"skips before and after step 25: {skips}"
    norms = [r["grad_norm"] for r in straight if "grad_norm" in r]  # a window of skipped steps only has none
    assert len(norms) > 30 and all(map(math.isfinite, norms)), "a skipped step's norm is no norm of an update"
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    out = args.index("--output-dir") + 1
    proc = run_trainer([*args[:out], str(tmp_path / "resumed"), *args[out + 1:], "--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "at step 25" in proc.stderr
    resumed = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"], r["skipped_micro_batches"]) for r in resumed] == [
        (r["step"], r["loss"], r["skipped_micro_batches"]) for r in straight]


def test_with_accumulation_the_guard_skips_micro_batches_and_the_steps_train_on(tiny_setup, tmp_path):
    """--grad-accum 2: a spike leaves its micro-batch out of the step (read before its backward),
    the other micro-batch's gradient still trains, and no non-finite norm reaches the log."""
    _, proc, records = spiky_run(tiny_setup, tmp_path / "accum", 30, "--grad-accum", "2")
    last = records[-1]
    assert last["skipped_micro_batches"] >= 1, "a factor of 1.002 makes some of the tiny run's losses spikes"
    # a step is skipped only where both of its micro-batches were
    assert 2 * last["skipped_steps"] <= last["skipped_micro_batches"], f"a spike skipped its whole step: {last}"
    trained = re.search(r"trained (\d+) steps?, skipped (\d+) in", proc.stderr)
    assert trained and int(trained[1]) > int(trained[2]), proc.stderr[-2000:]
    assert all(math.isfinite(r["grad_norm"]) for r in records if "grad_norm" in r)


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)], ids=["2-to-1", "1-to-2"])
def test_resume_on_another_number_of_drafter_ranks(tmp_path, before, after):
    """A node lost or added: the ZeRO-sharded state is resharded through DeepSpeed's universal
    layout, the epoch continues over the samples not yet used (tests/unit/data/test_sampler.py pins that
    exactly), the learning rate stays on its curve and the loss goes on without a jump. On the
    demo target and data, which a drafter learns quickly (random data would not show a jump)."""
    import torch

    from dflash.config import TrainArgs
    from dflash.training.schedules import LRSchedule

    # the demo drafter's loss is on its plateau (~2.05, from 4.2) by step 5: a checkpoint at 6 and
    # the 3 steps after the resume that the no-jump check reads are all that is trained
    steps, out = 9, tmp_path / "run"
    args = ["--output-dir", str(out), "--max-steps", str(steps), "--save-every", "6", "--log-every", "1",
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
    # the default schedule; --max-steps fixes the curve whatever the rank count
    schedule = LRSchedule(steps, 0.04, "wsd", min_warmup=TrainArgs.min_warmup_steps)
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


@pytest.fixture(scope="module")
def saved_every_2_steps(tiny_setup, tmp_path_factory) -> Path:
    """The output dir of a finished tiny run that saved every 2 steps; tests that change it work
    on a copy."""
    out = tmp_path_factory.mktemp("saved") / "run"
    proc = run_trainer(tiny_args(tiny_setup, out, "--save-every", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_a_resume_with_another_recipe_is_refused_before_training(tiny_setup, saved_every_2_steps):
    """A changed loss, learning rate or length on --resume would train another objective, or be
    overruled by the checkpoint's scheduler state, without a word: each is named, nothing trains."""
    out = saved_every_2_steps
    newest = latest_checkpoint(out)
    metrics = (out / "metrics.jsonl").read_text()
    proc = run_trainer([*tiny_args(tiny_setup, out, "--loss", "ce", "--lr", "1e-3", "--max-steps", "20"), "--resume"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"--resume from {newest}: --loss 'ce' (the checkpoint: 'dpace'); --lr 0.001 (the checkpoint: 0.0006); "
            "--max-steps 20 (the checkpoint: 8)") in proc.stderr
    assert "--overwrite instead of --resume" in proc.stderr
    assert (out / "metrics.jsonl").read_text() == metrics and latest_checkpoint(out) == newest


def test_resume_skips_damaged_checkpoints_names_them_and_logs_each_step_once(tiny_setup, saved_every_2_steps,
                                                                             tmp_path):
    """A checkpoint cut short after it was committed (a full disk, an interrupted copy) is skipped
    with its reason; the run goes on exactly from the newest intact one, and its closing line
    counts the steps this run trained."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(saved_every_2_steps, out)
    args = tiny_args(tiny_setup, out, "--save-every", "2")
    straight = losses_by_step(out)
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_4", "step_6", "step_8"]
    state = checkpoints / "step_8" / STATE_FILE
    state.write_text(state.read_text()[:40])
    weights = checkpoints / "step_6" / "mp_rank_00_model_states.pt"
    weights.write_bytes(weights.read_bytes()[:1000])
    proc = run_trainer([*args, "--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"--resume: skipping checkpoint step_8: {STATE_FILE} is truncated or corrupt" in proc.stderr
    assert "--resume: skipping checkpoint step_6: mp_rank_00_model_states.pt is truncated or corrupt" in proc.stderr
    assert f"resumed from {checkpoints / 'step_4'} at step 4" in proc.stderr
    assert "trained 4 steps" in proc.stderr and "(steps 5-8; resumed from step 4)" in proc.stderr
    assert losses_by_step(out) == straight  # steps 1-8 once each; 5-8 retrained exactly


def test_resume_with_every_checkpoint_damaged_is_one_clear_error(tmp_path):
    from dflash.training.drafter_setup import resume_point

    assert resume_point(tmp_path, log=True) is None  # nothing saved: the run starts from scratch
    for step in (2, 4):
        folder = tmp_path / "checkpoints" / f"step_{step}"
        folder.mkdir(parents=True)
        (folder / STATE_FILE).write_text('{"sampler": {"epoch": 0}}\n')
        torch.save({"module": torch.zeros(64)}, folder / "mp_rank_00_model_states.pt")
    assert resume_point(tmp_path, log=True) == tmp_path / "checkpoints" / "step_4"
    (tmp_path / "checkpoints" / "step_4" / STATE_FILE).write_text('{"sampler": {"ep')
    rng = tmp_path / "checkpoints" / "step_2" / "rng_rank0.pt"
    torch.save({"cpu": torch.zeros(8)}, rng)
    rng.write_bytes(rng.read_bytes()[:-30])
    with pytest.raises(CheckpointError) as failure:
        resume_point(tmp_path, log=True)
    message = str(failure.value)
    assert message.startswith(f"--resume: every checkpoint under {tmp_path / 'checkpoints'} is damaged (step_4: "
                              f"{STATE_FILE} is truncated or corrupt")
    assert "step_2: rng_rank0.pt is truncated or corrupt" in message and "--overwrite" in message


@pytest.mark.parametrize("world, placement", [(1, []), (2, ["--target-ranks", "1"])], ids=["x1", "split-1+1"])
def test_ctrl_c_ends_every_rank_with_one_line_naming_the_checkpoint(tiny_setup, tmp_path, world, placement):
    """SIGINT reaches every rank at once, as from a terminal's Ctrl-C: no traceback, exit code 130,
    and rank 0 says where the run stands and how to resume it."""
    out = tmp_path / "run"
    args = tiny_args(tiny_setup, out, *placement, "--save-every", "2")
    args[args.index("--max-steps") + 1] = "100000"
    procs = start_ranks(args, world, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while latest_checkpoint(out) is None:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no checkpoint was written"
            time.sleep(0.02)
        for p in procs:
            p.send_signal(signal.SIGINT)
        err = procs[0].communicate(timeout=60)[1]
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert codes == [130] * world, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if "interrupted at step " in line]
    assert len(lines) == 1, err[-3000:]
    newest = latest_checkpoint(out)
    assert lines[0].endswith(f"; the newest checkpoint is {newest}: resume with the same command plus --resume")


def test_an_interrupt_before_any_checkpoint_says_how_to_keep_one(tmp_path):
    from dflash.training.run import Interrupted
    from dflash.training.__main__ import interrupted_line

    config = SimpleNamespace(train=SimpleNamespace(output_dir=str(tmp_path)))
    assert interrupted_line(config, Interrupted(3)) == (
        "interrupted at step 3; no checkpoint was saved (one is kept every --save-every-minutes M, or --save-every "
        "N steps): start again with the same command plus --overwrite")
