"""Bad flags fail in a second with a message naming the flag (or file:line) and the fix,
before any model is loaded."""

from __future__ import annotations

import pytest
import torch

import train_drafter
from conftest import tiny_causal_lm
from dflash.target import TargetError, resolve_mask_token_id
from tiny_tokenizer import make_tiny_tokenizer


@pytest.fixture
def paths(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "hi", "response": "there"}\n')
    return {"target": str(target), "data": str(data), "tmp": tmp_path}


def fails_with(capsys, argv: list[str], *fragments: str) -> None:
    assert train_drafter.main(argv) == 2
    err = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in err, err


def test_missing_target_folder(capsys, paths):
    fails_with(capsys, ["--target", str(paths["tmp"] / "nope"), "--train-data", paths["data"]], "--target", "no such folder")


def test_target_without_data(capsys, paths):
    fails_with(capsys, ["--target", paths["target"]], "--train-data is required")


def test_missing_data_file(capsys, paths):
    fails_with(capsys, ["--target", paths["target"], "--train-data", str(paths["tmp"] / "x.jsonl")], "--train-data", "no such file")


@pytest.mark.parametrize("flags, fragment", [
    (["--block-size", "1"], "--block-size 1"),
    (["--block-size", "64", "--max-length", "32", "--max-tokens", "64"], "--block-size 64"),
    (["--max-anchors", "0"], "--max-anchors 0"),
    (["--overflow", "wrap"], "--overflow wrap"),
    (["--max-tokens", "100", "--max-length", "512"], "--max-tokens 100"),
    (["--report-to", "tensorboard"], "--report-to tensorboard"),
    (["--epochs", "0"], "--epochs 0: need at least 1"),
    (["--lr", "nan"], "--lr nan"),
    (["--lr=-1e-3"], "--lr -0.001"),
    (["--log-every", "0"], "--log-every 0"),
    (["--gamma", "0"], "--gamma 0.0"),
    (["--warmup-ratio", "1.5"], "--warmup-ratio 1.5"),
    (["--resume", "--overwrite"], "exclude each other"),
    (["--loss", "kl"], "--loss kl: use ce, dpace or ce+dpace"),
    (["--dpace-alpha", "0"], "--dpace-alpha 0.0"),
    (["--slot-weights", "linear"], "--slot-weights linear"),
    (["--gamma", "5"], "no effect with --loss dpace"),
    (["--slot-weights", "uniform"], "--slot-weights uniform: no effect with --loss dpace"),
    (["--muon-lr", "0.1"], "--muon-lr 0.1: only --optimizer muon uses it"),
    (["--loss", "ce", "--dpace-alpha", "0.7"], "--dpace-alpha 0.7: only --loss dpace or ce+dpace uses it"),
    (["--dpace-weight", "2"], "--dpace-weight 2.0: only --loss ce+dpace uses it"),
    (["--decay-ratio", "0.3"], "--decay-ratio 0.3: only --lr-schedule wsd uses it"),
    (["--anchors", "every"], "--anchors every"),
    (["--draft-window=-1"], "--draft-window -1"),
    (["--optimizer", "sgd"], "--optimizer sgd: use adamw or muon"),
    (["--attention-backend", "xformers"], "--attention-backend xformers: use auto, sdpa or flex"),
    (["--lr-schedule", "linear"], "--lr-schedule linear"),
    (["--lr-schedule", "wsd", "--warmup-ratio", "0.5", "--decay-ratio", "0.6"], "--decay-ratio 0.6"),
])
def test_impossible_settings(capsys, paths, flags, fragment):
    fails_with(capsys, ["--target", paths["target"], "--train-data", paths["data"], *flags], fragment)


def test_mask_token_resolution():
    tokenizer = make_tiny_tokenizer()
    spare = tiny_causal_lm(vocab_size=len(tokenizer) + 2).config
    assert resolve_mask_token_id(tokenizer, spare, None) == len(tokenizer)
    assert resolve_mask_token_id(tokenizer, spare, 5) == 5
    with pytest.raises(TargetError, match="--mask-token-id 9999"):
        resolve_mask_token_id(tokenizer, spare, 9999)
    full = tiny_causal_lm(vocab_size=len(tokenizer)).config
    with pytest.raises(TargetError, match="pass\n?.*--mask-token-id"):
        resolve_mask_token_id(tokenizer, full, None)


def test_deepspeed_launcher_local_rank_flag_is_accepted():
    from dflash.config import _without_launcher_flags

    assert _without_launcher_flags(["--local_rank=1", "--seed", "2"]) == ["--seed", "2"]
    assert _without_launcher_flags(["--local-rank", "0", "--seed", "2"]) == ["--seed", "2"]


def test_impossible_placements():
    from dflash.topology import TopologyError, plan_topology

    for count in (0, 4, 5):
        with pytest.raises(TopologyError, match=f"--target-ranks {count} with 4 processes"):
            plan_topology(count, 4)
    with pytest.raises(TopologyError, match="multiple of the node count"):
        plan_topology(3, 8, local_size=4)
    split = plan_topology(2, 8, local_size=4)
    assert split.target_ranks == [3, 7] and split.drafter_ranks == [0, 1, 2, 4, 5, 6]


def test_target_ranks_flag_is_checked_before_launching(capsys, paths):
    fails_with(capsys, ["--target", paths["target"], "--train-data", paths["data"], "--target-ranks", "half"],
               "--target-ranks half")


def test_an_output_dir_with_an_earlier_run_needs_resume_or_overwrite(capsys, paths):
    out = paths["tmp"] / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    fails_with(capsys, ["--target", paths["target"], "--train-data", paths["data"], "--output-dir", str(out)],
               f"--output-dir {out} holds an earlier run (metrics.jsonl, checkpoints)", "--resume", "--overwrite")


def test_a_bad_eval_file_is_refused_before_training(capsys, paths):
    bad = paths["tmp"] / "heldout.jsonl"
    bad.write_text('{"prompt": "hi", "response": "x"}\n{oops\n')
    fails_with(capsys, ["--target", paths["target"], "--train-data", paths["data"], "--eval-data", str(bad)],
               f"{bad}:2: malformed JSON")


def eval_fails_with(capsys, argv: list[str], *fragments: str) -> None:
    from dflash import eval as dflash_eval

    assert dflash_eval.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def test_eval_answers_bad_prompts_and_bad_drafter_folders_in_one_line(capsys, tmp_path):
    from conftest import tiny_drafter, tiny_target
    from dflash.export import WEIGHTS_NAME, export_drafter

    bad_prompts = tmp_path / "prompts.jsonl"
    bad_prompts.write_text('{"messages": [{"role": "robot", "content": "x"}]}\n')
    eval_fails_with(capsys, ["--prompts", str(bad_prompts)], f"{bad_prompts}:1: messages[0]: unknown role 'robot'")
    no_drafter = tmp_path / "nothing"
    no_drafter.mkdir()
    eval_fails_with(capsys, ["--drafter", str(no_drafter)], f"--drafter {no_drafter}: no config.json")
    drafter = export_drafter(tiny_drafter(tiny_target("qwen3", dtype=torch.float32)).float(), tmp_path / "drafter")
    weights = drafter / WEIGHTS_NAME
    weights.write_bytes(weights.read_bytes()[:100])  # an interrupted copy
    eval_fails_with(capsys, ["--drafter", str(drafter)], f"{weights}: cannot read the weights")
    eval_fails_with(capsys, ["--dtype", "float16"], "--dtype float16: use float32 or bfloat16")


def test_a_truncated_target_weight_file_is_named(tmp_path):
    from conftest import tiny_causal_lm
    from dflash.target import FrozenTarget

    folder = tmp_path / "target"
    tiny_causal_lm().save_pretrained(folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(TargetError, match=f"{weights} is truncated or corrupt: copy it again"):
        FrozenTarget.load(str(folder), [1, 2], torch.float32, torch.device("cpu"))
    with pytest.raises(TargetError, match="model.safetensors.*truncated or corrupt"):
        FrozenTarget.load_embedding_and_head(str(folder), torch.float32, torch.device("cpu"))


def test_train_and_eval_share_the_evaluation_checks(capsys, paths, tmp_path):
    """One rule set, each flag named as its own command spells it."""
    fails_with(capsys, ["--target", paths["target"], "--train-data", paths["data"], "--eval-max-new-tokens", "0"],
               "--eval-max-new-tokens 0: use at least 1")
    eval_fails_with(capsys, ["--max-new-tokens", "0"], "--max-new-tokens 0: use at least 1")
    fails_with(capsys, ["--target", paths["target"], "--train-data", paths["data"], "--eval-dtype", "half"],
               "--eval-dtype half: use float32 or bfloat16")
    missing = tmp_path / "missing.jsonl"
    eval_fails_with(capsys, ["--prompts", str(missing)], f"--prompts {missing}: no such file")
    eval_fails_with(capsys, ["--num-prompts", "0"], "--num-prompts 0: use at least 1")
