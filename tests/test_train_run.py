"""The real entry point end to end in a subprocess: a one-process DeepSpeed engine over gloo,
a tiny target saved as an HF folder, export, and the closing speculative-decoding evaluation."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_causal_lm
from tiny_tokenizer import make_tiny_tokenizer

REPO = Path(__file__).resolve().parent.parent
WORDS = "the cat sat on a mat and then it ran to the dog who was not happy at all".split()


def write_chat_jsonl(path: Path, samples: int, seed: int) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(samples):
            f.write(json.dumps({"prompt": " ".join(rng.choices(WORDS, k=6)),
                                "response": " ".join(rng.choices(WORDS, k=24))}) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    tokenizer = make_tiny_tokenizer()
    model = tiny_causal_lm("qwen3", vocab_size=len(tokenizer) + 3)  # spare rows: one is the mask
    model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    return {"root": root, "target": root / "target",
            "train": write_chat_jsonl(root / "train.jsonl", 48, 0),
            "heldout": write_chat_jsonl(root / "heldout.jsonl", 4, 1)}


def run_trainer(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "train_drafter.py"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_train_export_and_evaluate(tiny_setup):
    out = tiny_setup["root"] / "run"
    proc = run_trainer([
        "--target", str(tiny_setup["target"]), "--train-data", str(tiny_setup["train"]),
        "--eval-data", str(tiny_setup["heldout"]), "--eval-prompts", "2", "--eval-max-new-tokens", "16",
        "--output-dir", str(out), "--max-steps", "12", "--log-every", "4", "--num-draft-layers", "1",
        "--block-size", "4", "--max-anchors", "8", "--max-length", "96", "--max-tokens", "384",
        "--num-target-features", "2", "--report-to", "wandb",
    ])
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [4, 8, 12]
    assert all(len(r["acc"]) == 3 and r["loss"] > 0 for r in records)
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["block_size"] == 4 and config["num_hidden_layers"] == 1
    assert config["dflash_config"]["mask_token_id"] == len(make_tiny_tokenizer())
    reports = json.loads((out / "eval.json").read_text())
    assert set(reports) == {"untrained", "trained"}
    assert all(r["lossless"] and r["prompts"] == 2 and r["tau"] >= 1 for r in reports.values())
    assert list((out / "wandb").glob("offline-run-*")), "W&B offline run directory missing"
