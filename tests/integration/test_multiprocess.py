"""Multi-process runs of the real entry point under torchrun over gloo (CPU): colocated x2 and
the split placements, and the same losses from split 1+1 as from one colocated process."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import TINY_RUN_STEPS as STEPS
from conftest import BackgroundTrainer, run_trainer, start_ranks, tiny_args
from dflash.training.checkpoint import latest_checkpoint


def losses(out: Path) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return [r["loss"] for r in records]


def periodic_evals(out: Path) -> dict[int, list[float]]:
    """Step -> held-out tau, training-sample tau and held-out CE of each periodic eval."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["tau_step"]: [r["tau"], r["train_tau"], r["heldout_ce"]] for r in records if "tau_step" in r}


def with_periodic_tau(setup: dict) -> list[str]:
    """Flags after tiny_args' own (which turn evaluation off): the periodic tau every 2 steps on 2
    held-out prompts, and the final eval on them."""
    return ["--eval-data", str(setup["heldout"]), "--eval-prompts", "2", "--eval-every", "2",
            "--eval-max-new-tokens", "8"]


def test_split_one_plus_one_matches_colocated(tiny_setup, tmp_path):
    """Both echo each micro-batch once (--reuse-features 2): the target rank is asked for each
    micro-batch's features once, as the colocated target computes them once."""
    # the one-process run goes on alongside the split one: its start-up would leave a core idle
    split, single_process = tmp_path / "split", tmp_path / "colocated"
    echo = ["--reuse-features", "2", *with_periodic_tau(tiny_setup)]
    background = BackgroundTrainer(tiny_args(tiny_setup, single_process, *echo), tmp_path / "colocated.err")
    try:
        proc = run_trainer(tiny_args(tiny_setup, split, "--target-ranks", "1", *echo), nproc=2)
    finally:
        reference = background.result()
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "split: target on ranks [1], drafter on ranks [0]" in proc.stderr
    # Same data, anchors, initial weights and fp32 math whichever rank ran the target.
    assert losses(split) == pytest.approx(losses(single_process), rel=1e-5)
    # The periodic exact tau, from the sequences and features the target rank sent: as colocated
    evals, colocated = periodic_evals(split), periodic_evals(single_process)
    assert list(evals) == list(range(2, STEPS + 1, 2)) and list(colocated) == list(evals), (evals, colocated)
    for step, measures in evals.items():
        assert measures == pytest.approx(colocated[step], rel=1e-5), (step, evals, colocated)
    assert len({measures[2] for measures in evals.values()}) == len(evals)  # the held-out CE moves as it trains
    assert re.search(r"\[rank0\] INFO .*: step 2: tau \d\.\d\d \(exact, teacher-forced on \d held-out prompts",
                     proc.stderr), proc.stderr[-3000:]
    # The target rank's own time split: a line per request served (requests run ahead of the
    # drafter's steps: a drafter holds up to 2 x credits submitted), a log line per --log-every.
    # Only a micro-batch's first step asks for it: the even steps of the echoed plan.
    served = [json.loads(line) for line in (split / "target_metrics" / "rank1.jsonl").read_text().splitlines()]
    assert [r["requests"] for r in served] == list(range(1, len(served) + 1))
    assert STEPS // 2 <= len(served) <= STEPS // 2 + 2 * 4 and all(r["step"] % 2 == 0 for r in served), served
    assert all(r["rank"] == 1 and 0 <= r["forward_fraction"] <= r["serving_fraction"] <= 1 and 0 <= r["idle_fraction"] <= 1
               and r["forward_fraction"] > 0 for r in served)
    assert [r["wall_s"] for r in served] == sorted(r["wall_s"] for r in served)
    assert f"target rank 1 at step {served[-1]['step']}: {len(served)} requests | forward" in proc.stderr


def test_colocated_over_two_ranks_trains(tiny_setup, tmp_path):
    """The other placements train in tests/integration/test_resume.py, as the uninterrupted runs
    their resumed runs are compared with: split 1+1, and ZeRO-2 over 2 drafter ranks beside a target rank."""
    proc = run_trainer(tiny_args(tiny_setup, tmp_path, "--target-ranks", "colocated"), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "colocated: target and drafter on all 2 ranks" in proc.stderr
    run = losses(tmp_path)
    assert all(loss > 0 for loss in run)
    assert (tmp_path / "drafter" / "model.safetensors").is_file()


def test_the_final_eval_is_spread_over_the_target_ranks_and_checked_in_float32_on_rank_0(tiny_setup, tmp_path):
    """Split with two target ranks (and the KL term, whose final hidden states travel too, and a
    draft vocabulary, which the drafter rank cuts from the lm_head it loads alone): the two share
    the held-out prompts in bfloat16, rank 0 adds their tallies up and decodes the first prompts in
    float32 meanwhile, where speculative decoding must equal greedy."""
    proc = run_trainer(tiny_args(tiny_setup, tmp_path, "--target-ranks", "2", "--kl-weight", "0.5", "--draft-vocab",
                                 "40", "--eval-data",
                                 str(tiny_setup["heldout"]), "--eval-prompts", "3", "--eval-max-new-tokens", "8",
                                 "--eval-dtype", "bfloat16", "--eval-lossless-prompts", "2"), nproc=3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "split: target on ranks [1, 2], drafter on ranks [0]" in proc.stderr
    assert all(loss > 0 for loss in losses(tmp_path))
    assert "final evaluation of 3 held-out prompts in bfloat16 on ranks [1, 2]" in proc.stderr
    assert "final evaluation on ranks [1, 2] (2, 1 prompts)" in proc.stderr
    reports = json.loads((tmp_path / "eval.json").read_text())
    assert list(reports) == ["untrained", "trained", "trained_float32"]
    for name in ("untrained", "trained"):  # both shares, added up
        assert reports[name]["prompts"] == 3 and reports[name]["dtype"] == "bfloat16", reports[name]
        assert reports[name]["tokens"] >= 3 and reports[name]["teacher_forced_tau"] >= 1
    exact = reports["trained_float32"]
    assert exact["prompts"] == 2 and exact["dtype"] == "float32" and exact["lossless"], exact
    assert "draft vocabulary: the 40 tokens most frequent in the replies" in proc.stderr
    assert json.loads((tmp_path / "drafter" / "config.json").read_text())["dflash_config"]["draft_vocab_size"] == 40


def test_zero_over_two_drafter_ranks_applies_the_gradient_of_the_doubled_batch(tmp_path):
    """DeepSpeed's data-parallel group is the drafter group, and the loss is normalised over the
    whole step: with unequal micro-batches, ZeRO-1 and ZeRO-2 over 2 ranks and one rank
    accumulating both apply the gradient of both micro-batches pooled into one. Normalised per
    micro-batch, the small micro-batch would weigh as much as the large one: the gradient moves
    by tens of percent.

    Why the tolerance holds on any machine: the drafter runs in float64, so a micro-batch's
    gradient is the same in every run up to float64 rounding (~1e-16; the loss head's float32
    per-row terms come from the same rows alike). What differs between the runs is the engine's
    reduction, which keeps gradients in float32 (its master precision) and adds the micro-batches'
    parts in another order: each element is the float32 rounding of a sum of two float32
    roundings, within a few float32 ulps (2**-23 ~ 1.2e-7) of the parts' scale by IEEE 754 alone,
    whatever the CPU or BLAS. Nothing on the way divides by a gradient-dependent quantity (plain
    SGD, no clipping; the slot weights are powers of two, so the denominators are exact sums), so
    nothing magnifies that: Adam's division by each element's own gradient scale once turned it
    into a visible weight change on some machines. The bound, 1e-6 of each tensor's largest
    element, is about 8 float32 ulps (measured: 1.5e-7); per-micro-batch normalisation moves the
    gradient by about half."""
    import os
    import subprocess
    import sys

    import torch

    from conftest import REPO, free_port

    # the one-rank and the two-rank runs go on at once (each writes its own file; float64
    # gradients do not depend on what else runs): most of each run is its one-core start-up
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}", "DS_ACCELERATOR": "cpu"}
    runs = {}
    for nproc, modes in ((1, "pooled,global"), (2, "global,local")):
        out, log = tmp_path / f"gradients-{nproc}.pt", tmp_path / f"gradients-{nproc}.err"
        with log.open("w") as err:
            runs[nproc] = out, log, subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                 str(free_port()), str(REPO / "tests" / "zero_worker.py"), str(out), modes],
                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
    results = {}
    try:
        for nproc, (out, log, proc) in runs.items():
            assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
            results.update({(nproc, *key): steps for key, steps in torch.load(out).items()})
    finally:
        for _, _, proc in runs.values():
            proc.kill()
            proc.wait()

    def gap(nproc: int, mode: str, stage: int) -> float:
        """The largest difference from the pooled reference, relative to each tensor's largest element."""
        run, reference = results[nproc, mode, stage], results[1, "pooled", stage]
        assert len(run) == len(reference) == 2
        return max(float((mine[name] - grad).abs().max() / grad.abs().max())
                   for mine, ref in zip(run, reference) for name, grad in ref.items())

    for stage in (1, 2):
        same = {(nproc, stage): gap(nproc, "global", stage) for nproc in (1, 2)}
        assert max(same.values()) < 1e-6, same
        assert gap(2, "local", stage) > 0.05, gap(2, "local", stage)


def test_two_nodes_on_one_machine(tiny_setup, tmp_path):
    """Two `torchrun --nnodes 2` invocations over localhost: one target and one drafter rank per
    node; the run reports which drafter/target pairs crossed nodes."""
    import os
    import subprocess
    import sys

    from conftest import REPO, free_port

    port = free_port()
    args = tiny_args(tiny_setup, tmp_path, "--target-ranks", "2")
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
         "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
         str(REPO / "train_drafter.py"), *args],
        cwd=REPO, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    log = outputs[0][1]
    assert "split: target on ranks [1, 3], drafter on ranks [0, 2] (2:2, 2 node(s))" in log
    assert "routing (drafter rank <- target rank: micro-batches):" in log
    node_of = {0: 0, 1: 0, 2: 1, 3: 1}
    pairs = re.findall(r"^  (\d) <- (\d): (\d+)(  \(crossed nodes\))?$", log, flags=re.M)
    assert pairs, log[-2000:]
    for drafter, target, count, crossed in pairs:
        assert bool(crossed) == (node_of[int(drafter)] != node_of[int(target)])
    assert sum(int(count) for _, _, count, _ in pairs) == 2 * STEPS  # every micro-batch of both drafters
    assert len(losses(tmp_path)) == STEPS


def lost_peer_lines(err: str) -> list[str]:
    return [line.split("ERROR dflash.train: ", 1)[1] for line in err.splitlines() if "ERROR dflash.train: " in line]


def check_survivor(err: str, rank: int, dead: str) -> None:
    """One line, no traceback: this rank and its step, the dead rank and where its log is, the newest
    checkpoint and the resume command."""
    assert "Traceback" not in err, err[-3000:]
    lines = lost_peer_lines(err)
    assert len(lines) == 1, err[-3000:]
    assert re.match(rf"rank {rank} \((drafter|target)\) at step \d+: ", lines[0]), lines
    victim = dead.rsplit(" ", 1)[1]
    assert f"{dead} died or exited (its log: the lines tagged [rank{victim}] in the launcher's" in lines[0], lines
    newest = re.search(r"; the newest checkpoint is (\S+): resume with the same command plus --resume$", lines[0])
    assert newest and Path(newest[1]).is_dir(), lines


def wait_for_a_checkpoint(out: Path, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 240
    while latest_checkpoint(out) is None:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no checkpoint was written"
        time.sleep(0.05)


def long_split_run(setup: dict, out: Path) -> list[str]:
    """Three ranks (drafters 0 and 1, target 2), saving every 2 steps, training until stopped."""
    args = tiny_args(setup, out, "--target-ranks", "1", "--save-every", "2")
    args[args.index("--max-steps") + 1] = "100000"
    return args


@pytest.mark.parametrize("victim, dead", [(2, "target rank 2"), (1, "drafter rank 1")], ids=["target", "drafter"])
def test_a_killed_rank_ends_every_other_rank_with_one_line_and_no_traceback(tiny_setup, tmp_path, victim, dead):
    """No launcher in between (one would stop the others itself): each surviving rank notices the
    loss on its own, from a transfer or a collective that fails, and exits with code 1."""
    logs = [tmp_path / f"rank{r}.err" for r in range(3)]
    files = [log.open("w") for log in logs]
    procs = start_ranks(long_split_run(tiny_setup, tmp_path / "run"), 3, stderr=files)
    try:
        wait_for_a_checkpoint(tmp_path / "run", procs)
        procs[victim].kill()
        codes = {r: p.wait(timeout=120) for r, p in enumerate(procs) if r != victim}
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for f in files:
            f.close()
    for rank, code in codes.items():
        err = logs[rank].read_text()
        assert code == 1, err[-3000:]
        check_survivor(err, rank, dead)


def test_under_torchrun_the_ranks_it_stops_after_a_death_name_the_dead_rank(tiny_setup, tmp_path):
    """torchrun (deepspeed and accelerate alike) sends SIGTERM to the other ranks once one died,
    before they may have noticed it: each says so in one line all the same. The launcher's own
    report follows; each rank's stderr is its own file here (--redirects)."""
    import os
    import sys

    import psutil

    from conftest import REPO, free_port

    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--master_port", str(free_port()),
         "--log-dir", str(tmp_path / "logs"), "--redirects", "2", str(REPO / "train_drafter.py"),
         *long_split_run(tiny_setup, tmp_path / "run")],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_a_checkpoint(tmp_path / "run", [launcher])
        ranks = {int(child.environ()["RANK"]): child for child in psutil.Process(launcher.pid).children()}
        ranks[2].kill()
        assert launcher.wait(timeout=120) != 0
    finally:
        launcher.kill()
        launcher.wait()
    for rank in (0, 1):
        (err_file,) = (tmp_path / "logs").glob(f"*/attempt_0/{rank}/stderr.log")
        check_survivor(err_file.read_text(), rank, "target rank 2")


def test_a_target_stalled_after_the_last_step_costs_a_warning_not_the_drafter(tiny_setup, tmp_path):
    """A target rank stopped (SIGSTOP) once it has served what the drafter still needs: the drafter
    finishes, saves, exports, warns that the target did not answer the requests sent ahead, and
    exits 0 without waiting for it at the final barrier."""
    # --credits 8: the drafter asks for up to 8 steps ahead, so the target can answer all the
    # steps trained while requests sent ahead past the last one are left unanswered
    args = tiny_args(tiny_setup, tmp_path, "--target-ranks", "1", "--save-every", "2", "--transport-timeout-s", "10",
                     "--credits", "8")
    procs = start_ranks(args, 2, stderr=subprocess.PIPE)
    served = tmp_path / "target_metrics" / "rank1.jsonl"
    try:
        deadline = time.monotonic() + 180
        # stop the target once the responses for every step trained have left it (a transfer still
        # in flight would stop with it)
        while not (served.exists() and max(map(int, re.findall(r'"responses_sent": (\d+)', served.read_text())),
                                           default=0) >= STEPS):
            assert time.monotonic() < deadline and procs[0].poll() is None, "the target never answered the last step"
            time.sleep(0.01)
        procs[1].send_signal(signal.SIGSTOP)
        _, err = procs[0].communicate(timeout=120)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode == 0, err[-3000:]
    assert (tmp_path / "drafter" / "model.safetensors").is_file()
    assert (tmp_path / "checkpoints" / f"step_{STEPS}").is_dir()
    warnings = [line for line in err.splitlines() if "after the last step: " in line]
    assert len(warnings) == 1, err[-3000:]
    assert "timed out after 10 s" in warnings[0] and "target rank 1" in warnings[0], warnings
    assert f"the drafter is exported to {tmp_path / 'drafter'}" in warnings[0]
    assert len(losses(tmp_path)) == STEPS


def stop_a_target_mid_run(args: list[str], out: Path, sig: int) -> tuple[str, float]:
    """Start drafter rank 0 and target rank 1, send `sig` to the target once training runs;
    returns the drafter's stderr and how long it took to exit (it must exit non-zero)."""
    args = list(args)
    args[args.index("--max-steps") + 1] = "100000"
    procs = start_ranks(args, 2, stderr=subprocess.PIPE)
    metrics = out / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 180
        while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            assert time.monotonic() < deadline and procs[0].poll() is None, "training never started"
            time.sleep(0.2)
        procs[1].send_signal(sig)
        stopped_at = time.monotonic()
        try:
            _, err = procs[0].communicate(timeout=150)
        except subprocess.TimeoutExpired:
            procs[0].send_signal(signal.SIGUSR1)  # its stacks, for the failure message
            time.sleep(2)
            procs[0].kill()
            raise AssertionError("the drafter did not exit: " + procs[0].communicate()[1][-8000:]) from None
        assert procs[0].returncode != 0
        return err, time.monotonic() - stopped_at
    finally:
        for p in procs:
            p.kill()
            p.wait()
