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
from conftest import run_trainer, start_ranks, tiny_args


def losses(out: Path) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return [r["loss"] for r in records]


@pytest.fixture(scope="module")
def single_process_losses(tiny_setup, tmp_path_factory) -> list[float]:
    out = tmp_path_factory.mktemp("colocated1")
    proc = run_trainer(tiny_args(tiny_setup, out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(out)


def test_split_one_plus_one_matches_colocated(tiny_setup, tmp_path, single_process_losses):
    proc = run_trainer(tiny_args(tiny_setup, tmp_path, "--target-ranks", "1"), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "split: target on ranks [1], drafter on ranks [0]" in proc.stderr
    # Same data, anchors, initial weights and fp32 math whichever rank ran the target.
    assert losses(tmp_path) == pytest.approx(single_process_losses, rel=1e-5)


@pytest.mark.parametrize("nproc, placement, expect", [
    (2, ["--target-ranks", "colocated"], "colocated: target and drafter on all 2 ranks"),
    (3, ["--target-ranks", "2", "--kl-weight", "0.5"], "split: target on ranks [1, 2], drafter on ranks [0]"),
    (3, ["--target-ranks", "1", "--deepspeed-config", "ds_configs/zero2.json"],
     "split: target on ranks [2], drafter on ranks [0, 1]"),
])
def test_placements_train(tiny_setup, tmp_path, nproc, placement, expect):
    proc = run_trainer(tiny_args(tiny_setup, tmp_path, *placement), nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert expect in proc.stderr
    run = losses(tmp_path)
    assert all(loss > 0 for loss in run)
    assert (tmp_path / "drafter" / "model.safetensors").is_file()


def test_zero2_over_two_drafter_ranks_matches_one_rank_on_the_doubled_batch(tmp_path):
    """DeepSpeed's data-parallel group is the drafter group, and the loss is normalised over the
    whole step: with unequal micro-batches, ZeRO-2 over 2 ranks and one rank accumulating both
    apply the update of both micro-batches pooled into one. Normalised per micro-batch, the
    small micro-batch would weigh as much as the large one, and the result differs."""
    import os
    import subprocess
    import sys

    import torch

    from conftest import REPO, free_port

    results = {}
    for nproc, mode in ((1, "pooled"), (1, "global"), (2, "global"), (2, "local")):
        out = tmp_path / f"weights-{nproc}-{mode}.json"
        env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}", "DS_ACCELERATOR": "cpu"}
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
             str(free_port()), str(REPO / "tests" / "zero_worker.py"), str(out), mode],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[nproc, mode] = json.loads(out.read_text())
    assert {r["global_steps"] for r in results.values()} == {3}

    def gap(run) -> float:
        reference = results[1, "pooled"]["state"]
        return max(float((torch.tensor(results[run]["state"][name]) - torch.tensor(value)).abs().max())
                   for name, value in reference.items())

    # Summing gradients in another order leaves float32 noise of ~1e-7 relative, which Adam can
    # turn into ~1e-6 in a near-zero element; a wrong normalisation moves weights by a good
    # fraction of a step (lr 1e-2).
    assert gap((1, "global")) < 1e-4 and gap((2, "global")) < 1e-4, (gap((1, "global")), gap((2, "global")))
    assert gap((2, "local")) > 1e-3, gap((2, "local"))


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


def test_killed_target_rank_ends_the_drafter_with_a_clear_error(tiny_setup, tmp_path):
    """No launcher in between (torchrun would tear the group down itself): the drafter rank must
    notice on its own that its target rank died, and exit with an error naming it."""
    err, seconds = stop_a_target_mid_run(tiny_args(tiny_setup, tmp_path, "--target-ranks", "1"), tmp_path,
                                         signal.SIGKILL)
    assert seconds < 90
    assert "TransportError" in err and "target rank 1" in err, err[-2000:]


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
