"""Multi-process runs of the real entry point under torchrun over gloo (CPU): colocated x2 and
the split placements, and the same losses from split 1+1 as from one colocated process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_trainer

STEPS = 8


def tiny_args(setup: dict, out: Path, *extra: str) -> list[str]:
    return ["--target", str(setup["target"]), "--train-data", str(setup["train"]), "--output-dir", str(out),
            "--max-steps", str(STEPS), "--log-every", "1", "--num-draft-layers", "1", "--block-size", "4",
            "--max-anchors", "8", "--max-length", "96", "--max-tokens", "256", "--num-target-features", "2",
            "--report-to", "none", "--eval-prompts", "0", "--transport-timeout-s", "60", "--seed", "3", *extra]


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
    (3, ["--target-ranks", "2"], "split: target on ranks [1, 2], drafter on ranks [0]"),
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
