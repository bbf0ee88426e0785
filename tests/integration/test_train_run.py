"""The real entry point end to end in a subprocess: a one-process DeepSpeed engine over gloo,
a tiny target saved as an HF folder, export, and the closing speculative-decoding evaluation."""

from __future__ import annotations

import functools
import json
import re
import subprocess
from pathlib import Path

import pytest

from conftest import run_trainer, run_two_at_a_time, tiny_args
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


def test_one_percent_bad_samples_train_on_the_rest_and_a_reused_output_dir_is_refused(tiny_setup, tmp_path, capsys):
    from conftest import write_chat_jsonl
    from dflash.training import __main__ as train_drafter

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
    assert "trained 2 steps, skipped 0 in" in proc.stderr
    assert "skipped 1 bad samples of 100 ({'empty assistant turn': 1})" in proc.stderr
    assert f"{data}:100" in (out / "data" / "train" / "bad_samples.txt").read_text()

    assert train_drafter.main(args) == 2  # refused while parsing the flags: no process of its own needed
    refused = capsys.readouterr().err
    assert "holds an earlier run" in refused and "--overwrite" in refused
    (out / "metrics.jsonl").write_text('{"step": 99}\n')  # what the old run left must go
    fresh = run_trainer([*args, "--overwrite"])
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


# --lr, --max-steps, --save-every: with no save due, the blow-up is read one step late (UpdateCheck)
BLOW_UPS = [("1e9", "2", "1"), ("1e30", "8", "0")]


@pytest.fixture(scope="module")
def blow_up_runs(tiny_setup, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """--lr -> (its run of BLOW_UPS, its output dir); the two runs go at once."""
    runs = {}
    for lr, steps, save_every in BLOW_UPS:
        out = tmp_path_factory.mktemp(f"lr{lr}")
        args = tiny_args(tiny_setup, out, "--lr", lr, "--save-every", save_every)
        args[args.index("--max-steps") + 1] = steps
        runs[lr] = args, out
    procs = run_two_at_a_time({lr: functools.partial(run_trainer, args) for lr, (args, _) in runs.items()})
    return {lr: (procs[lr], out) for lr, (_, out) in runs.items()}


@pytest.mark.parametrize("lr, steps, save_every", BLOW_UPS)
def test_a_run_whose_update_blows_the_weights_up_stops_and_exports_nothing(blow_up_runs, lr, steps, save_every):
    """--lr 1e9 for 2 steps: the first update takes the weights' norm from ~17 to ~1e11. The run
    stops there (with a save due after every step), or one step later where none is due, with the
    message a run of mostly skipped steps gives, instead of exiting 0 with those weights exported
    as its drafter; nor are they kept as a checkpoint to resume from."""
    from dflash.training.checkpoint import latest_checkpoint

    proc, out = blow_up_runs[lr]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for fragment in ("training stopped: the update of step 1 took the drafter's weights from norm ",
                     f"the learning rate is too high (--lr {float(lr):g}): start again with a lower --lr",
                     "No drafter was exported", "No checkpoint was saved"):
        assert fragment in proc.stderr, proc.stderr[-3000:]
    trained = re.search(r"trained (\d+) steps?, skipped (\d+) in all", proc.stderr)
    assert trained, proc.stderr[-3000:]
    assert trained.group(1, 2) == ("1", "0") if save_every == "1" else int(trained.group(1)) + int(trained.group(2)) == 2
    assert not (out / "drafter").exists() and latest_checkpoint(out) is None


def test_precision_bf16_trains_on_cpu(tiny_setup, tmp_path):
    """DeepSpeed's bf16 engine runs on CPU over gloo: --precision bf16 there trains like on a GPU."""
    import torch

    args = tiny_args(tiny_setup, tmp_path, "--precision", "bf16", "--save-every", "3")
    args[args.index("--max-steps") + 1] = "3"
    proc = run_trainer(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["loss"] > 0 for r in records)
    weights = torch.load(tmp_path / "checkpoints" / "step_3" / "mp_rank_00_model_states.pt", weights_only=False)
    assert {str(w.dtype) for w in weights["module"].values()} == {"torch.bfloat16"}


def test_the_decoder_layers_and_packed_target_forwards_train_on_the_features_of_hf_layers(tiny_setup, tmp_path):
    """--target-forward decoder computes the features with the fast decoder's layer functions, and
    packed with HF's layers over the real tokens only: the first step's loss, before any update, is
    HF's padded forward's up to float32 rounding; auto (the default) packs the rows."""
    def first_loss(kind: str) -> float:
        args = tiny_args(tiny_setup, tmp_path / kind, "--target-forward", kind)
        args[args.index("--max-steps") + 1] = "1"
        proc = run_trainer(args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert ("from the fast decoder's layer functions" in proc.stderr) == (kind == "decoder")
        assert ("rows packed into one sequence (--target-forward auto)" in proc.stderr) == (kind == "auto")
        assert ("computes the padded micro-batch" in proc.stderr) == (kind == "hf")
        return json.loads((tmp_path / kind / "metrics.jsonl").read_text().splitlines()[0])["loss"]

    losses = run_two_at_a_time({kind: lambda kind=kind: first_loss(kind) for kind in ("hf", "decoder", "auto")})
    assert losses["decoder"] == pytest.approx(losses["hf"], rel=1e-5)
    assert losses["auto"] == pytest.approx(losses["hf"], rel=1e-5)


@pytest.mark.gpu
def test_on_a_gpu_the_final_eval_runs_in_bfloat16_with_a_float32_check(tiny_setup, tmp_path):
    """--eval-dtype auto on CUDA: the drafters are judged in bfloat16, as served, and the trained one
    also on the first --eval-lossless-prompts in float32, where it must equal greedy; the target
    computed the features over packed rows (--target-forward auto)."""
    proc = run_trainer(tiny_args(tiny_setup, tmp_path, "--device", "cuda", "--eval-data", str(tiny_setup["heldout"]),
                                 "--eval-prompts", "3", "--eval-max-new-tokens", "8", "--eval-lossless-prompts", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rows packed into one sequence (--target-forward auto)" in proc.stderr  # the default on a GPU
    reports = json.loads((tmp_path / "eval.json").read_text())
    assert [(name, r["dtype"], r["prompts"]) for name, r in reports.items()] == [
        ("untrained", "bfloat16", 3), ("trained", "bfloat16", 3), ("trained_float32", "float32", 2)]
    assert reports["trained_float32"]["lossless"]


def test_a_budget_of_minutes_ends_the_run_on_time_with_the_lr_decayed(tiny_setup, tmp_path):
    """--max-minutes with 1000 epochs, split over 2 drafter ranks and a target rank: the steps that
    fit are estimated as the run goes (the drafter ranks agree on them), the LR curve ends at the
    last of them, and checkpoints record the time spent."""
    out = tmp_path / "run"
    budget_s = 6.0
    proc = run_trainer(tiny_args(tiny_setup, out, "--max-steps", "-1", "--epochs", "1000", "--max-minutes",
                                 str(budget_s / 60), "--log-every", "1", "--save-every", "40", "--target-ranks", "1"),
                       nproc=3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"--max-minutes {budget_s / 60:g}: " in proc.stderr and "the run's total is now" in proc.stderr
    trained = proc.stderr.split("trained ")[1]
    steps, seconds = int(trained.split()[0]), float(trained.split(" in ")[1].split()[0])
    assert 0.7 * budget_s <= seconds <= 1.3 * budget_s + 1.0, trained[:80]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"lr"' in line]
    assert records[-1]["step"] == steps > 40
    assert max(r["lr"] for r in records) == pytest.approx(6e-4) and records[-1]["lr"] < 0.25 * 6e-4
    saved = max((out / "checkpoints").glob("step_*"), key=lambda path: int(path.name.split("_")[1]))
    state = json.loads((saved / "trainer_state.json").read_text())
    assert 0 < state["time_budget"]["spent_s"] < seconds
