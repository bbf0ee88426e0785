"""Split placement over NCCL on two GPUs (run on a 2-GPU host: python -m pytest -m gpu): each
launcher trains 20 steps; split 1+1 equals colocated x1 in fp32; a target rank that dies or
stops sending ends the drafter within the transport timeout with an error naming it; colocated
x2 shares the final eval out over both GPUs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, free_port, tiny_args
from test_multiprocess import stop_a_target_mid_run

pytestmark = pytest.mark.gpu
# Short, so that the dead-peer tests end fast; training runs get more, since the drafter's first
# steps compile for a while on a busy host and its targets wait through that.
TIMEOUT_S = 20
RUN_TIMEOUT_S = 120


@pytest.fixture(autouse=True)
def two_gpus():
    assert torch.cuda.device_count() >= 2, "these tests need two CUDA devices"


def gpu_args(setup: dict, out: Path, *extra: str, timeout_s: float = RUN_TIMEOUT_S) -> list[str]:
    args = tiny_args(setup, out, "--device", "cuda", *extra)
    args[args.index("--transport-timeout-s") + 1] = str(timeout_s)
    return args


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


LAUNCHERS = {
    "torchrun": lambda: [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                         "--master_port", str(free_port())],
    "deepspeed": lambda: [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
                          "--master_port", str(free_port())],
    "accelerate": lambda: [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           str(REPO / "launch" / "accelerate_8gpu.yaml"), "--num_processes", "2",
                           "--main_process_port", str(free_port())],
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_split_one_plus_one_trains_20_steps_over_nccl(tiny_setup, tmp_path, launcher):
    args = gpu_args(tiny_setup, tmp_path, "--target-ranks", "1")
    args[args.index("--max-steps") + 1] = "20"
    proc = subprocess.run([*LAUNCHERS[launcher](), str(REPO / "train_drafter.py"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "split: target on ranks [1], drafter on ranks [0]" in log
    assert [r["step"] for r in metrics(tmp_path)] == list(range(1, 21))
    assert (tmp_path / "drafter" / "model.safetensors").is_file()


def test_split_one_plus_one_matches_colocated_x1_in_fp32(tiny_setup, tmp_path):
    runs = {}
    for name, nproc, placement in (("colocated", 0, "colocated"), ("split", 2, "1")):
        out = tmp_path / name
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                    "--master_port", str(free_port())] if nproc else [sys.executable]
        proc = subprocess.run([*launcher, str(REPO / "train_drafter.py"),
                               *gpu_args(tiny_setup, out, "--target-ranks", placement, "--precision", "fp32")],
                              cwd=REPO, capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[name] = [r["loss"] for r in metrics(out)]
    # same data, anchors, weights and fp32 math; the GPU's backward kernels may accumulate in a
    # different order from run to run, so later steps may differ in the last bits
    assert runs["split"] == pytest.approx(runs["colocated"], rel=1e-4)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_target_that_dies_or_stops_ends_the_drafter_within_the_timeout(tiny_setup, tmp_path, sig):
    err, seconds = stop_a_target_mid_run(gpu_args(tiny_setup, tmp_path, "--target-ranks", "1", timeout_s=TIMEOUT_S),
                                         tmp_path, sig)
    assert seconds <= TIMEOUT_S + 15, (seconds, err[-2000:])
    assert "Traceback" not in err and "rank 0 (drafter) at step " in err and "target rank 1" in err, err[-2000:]


def test_colocated_on_two_gpus_the_final_eval_is_shared_by_both(tiny_setup, tmp_path):
    """Each GPU judges its share of the held-out prompts in bfloat16 (auto on CUDA); rank 0 adds
    them up and checks the first ones in float32."""
    args = gpu_args(tiny_setup, tmp_path, "--target-ranks", "colocated", "--eval-data", str(tiny_setup["heldout"]),
                    "--eval-prompts", "3", "--eval-max-new-tokens", "8", "--eval-lossless-prompts", "2")
    proc = subprocess.run([*LAUNCHERS["torchrun"](), str(REPO / "train_drafter.py"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "final evaluation on ranks [0, 1] (2, 1 prompts)" in proc.stderr
    reports = json.loads((tmp_path / "eval.json").read_text())
    assert reports["trained"]["prompts"] == 3 and reports["trained"]["dtype"] == "bfloat16"
    assert reports["trained_float32"]["prompts"] == 2 and reports["trained_float32"]["lossless"]
