"""The real entry point end to end in a subprocess: a one-process DeepSpeed engine over gloo,
a tiny target saved as an HF folder, export, and the closing speculative-decoding evaluation."""

from __future__ import annotations

import json

from conftest import run_trainer
from tiny_tokenizer import make_tiny_tokenizer


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


def test_one_percent_bad_samples_train_on_the_rest_and_a_reused_output_dir_is_refused(tiny_setup, tmp_path):
    from conftest import write_chat_jsonl

    data = write_chat_jsonl(tmp_path / "train.jsonl", 99, seed=5)
    with data.open("a") as f:
        f.write('{"prompt": "a", "response": ""}\n')  # line 100: an empty reply
    out = tmp_path / "run"
    args = ["--target", str(tiny_setup["target"]), "--train-data", str(data), "--output-dir", str(out),
            "--max-steps", "2", "--log-every", "1", "--num-draft-layers", "1", "--block-size", "4",
            "--max-anchors", "8", "--max-length", "96", "--max-tokens", "384", "--num-target-features", "2",
            "--report-to", "none", "--eval-prompts", "0"]
    proc = run_trainer(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped 1 bad samples of 100 ({'empty assistant turn': 1})" in proc.stderr
    assert f"{data}:100" in (out / "data" / "train" / "bad_samples.txt").read_text()

    again = run_trainer(args)
    assert again.returncode == 2 and "holds an earlier run" in again.stderr and "--overwrite" in again.stderr
    (out / "metrics.jsonl").write_text('{"step": 99}\n')  # what the old run left must go
    fresh = run_trainer([*args, "--overwrite"])
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
