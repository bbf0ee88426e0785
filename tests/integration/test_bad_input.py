"""Bad flags fail in a second with a message naming the flag (or file:line) and the fix,
before any model is loaded."""

from __future__ import annotations

import pytest
import torch

from dflash.training import __main__ as train_drafter
from conftest import tiny_causal_lm
from dflash.target.frozen import TargetError, resolve_mask_token_id
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
    (["--preset", "tiny"], "--preset tiny: use auto or one of recipe, small, demo"),
    (["--block-size", "64", "--max-length", "32", "--max-tokens", "64"], "--block-size 64"),
    (["--max-anchors", "0"], "--max-anchors 0"),
    (["--reuse-features", "0"], "--reuse-features 0: use 1"),
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
    (["--lr-schedule", "cosine", "--decay-ratio", "0.3"], "--decay-ratio 0.3: only --lr-schedule wsd uses it"),
    (["--anchors", "every"], "--anchors every"),
    (["--draft-window=-1"], "--draft-window -1"),
    (["--target-length-groups", "0"], "--target-length-groups 0: use 1 (one forward over the padded micro-batch)"),
    (["--target-forward", "packed", "--target-length-groups", "4"],
     "--target-forward packed with --target-length-groups 4: packed rows compute no padding at all"),
    (["--target-forward", "unpadded"], "--target-forward unpadded: use auto, hf, decoder or packed"),
    (["--optimizer", "sgd"], "--optimizer sgd: use adamw or muon"),
    (["--attention-backend", "xformers"], "--attention-backend xformers: use auto, sdpa or flex"),
    (["--lr-schedule", "linear"], "--lr-schedule linear"),
    (["--lr-schedule", "wsd", "--warmup-ratio", "0.5", "--decay-ratio", "0.6"], "--decay-ratio 0.6"),
    (["--save-every=-1"], "--save-every -1: use a positive step count, or 0 for no periodic checkpoints"),
    (["--save-every-minutes", "0"], "--save-every-minutes 0.0: use a positive number of minutes"),
    (["--save-every", "0", "--save-every-minutes", "5"], "--save-every 0 turns periodic checkpoints off, "
                                                         "--save-every-minutes 5.0 asks for them"),
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
    tokenizer.add_tokens(["[PAD3]"])  # a real token, spelled like the placeholder of another row
    with pytest.raises(TargetError, match="pass\n?.*--mask-token-id"):
        resolve_mask_token_id(tokenizer, tiny_causal_lm(vocab_size=len(tokenizer)).config, None)


def test_deepspeed_launcher_local_rank_flag_is_accepted():
    from dflash.util.cli import without_launcher_flags

    assert without_launcher_flags(["--local_rank=1", "--seed", "2"]) == ["--seed", "2"]
    assert without_launcher_flags(["--local-rank", "0", "--seed", "2"]) == ["--seed", "2"]


def test_impossible_placements():
    from dflash.placement.topology import TopologyError, plan_topology

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


def test_an_output_dir_that_cannot_be_a_folder_is_refused_before_set_up(capsys, paths):
    for out, problem in ((paths["data"], "is a file, not a folder"),
                         ("/proc/x", "cannot be created or written (No such file or directory)"),
                         (f"{paths['data']}/run", "cannot be created or written (Not a directory)")):
        fails_with(capsys, ["--target", paths["target"], "--train-data", paths["data"], "--output-dir", out],
                   f"--output-dir {out} {problem}: pass a folder you can write to")
    from dflash.config import parse_config

    fresh = paths["tmp"] / "new" / "run"
    assert parse_config(["--target", paths["target"], "--train-data", paths["data"], "--output-dir", str(fresh)])
    assert fresh.is_dir() and not any(fresh.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a visible GPU")
def test_device_cuda_without_a_gpu_is_refused_before_set_up(capsys, paths):
    fails_with(capsys, ["--target", paths["target"], "--train-data", paths["data"], "--device", "cuda"],
               "--device cuda: no CUDA device is visible on this machine; use --device cpu")


def test_a_preset_fills_only_the_flags_left_unset(paths):
    from dflash.config import SMALL, parse_config

    def settings(*flags):
        config = parse_config(["--target", paths["target"], "--train-data", paths["data"], *flags], for_training=False)
        return (config.model.block_size, config.train.max_anchors, config.model.draft_vocab, config.data.cut_replies,
                config.model.num_draft_layers)

    assert settings() == settings("--preset", "recipe") == (16, 512, 0, "drop", 5)  # auto: the recipe
    assert settings("--preset", "small") == (SMALL["block_size"], SMALL["max_anchors"], SMALL["draft_vocab"],
                                             SMALL["cut_replies"], SMALL["num_draft_layers"]) == (8, 128, 32768, "keep", 3)
    assert settings("--preset", "small", "--block-size", "16", "--draft-vocab", "0", "--cut-replies", "drop") \
        == (16, 128, 0, "drop", 3)


def test_report_to_wandb_without_the_package_is_refused_before_set_up(capsys, paths, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    fails_with(capsys, ["--target", paths["target"], "--train-data", paths["data"]],
               "--report-to wandb: the wandb package is not installed", "--report-to none")
    # the data tools (`python -m dflash.tools.data prepare`) report nothing, so they need no wandb
    from dflash.config import parse_config

    assert parse_config(["--target", paths["target"], "--train-data", paths["data"]], for_training=False)


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
    from dflash.eval import __main__ as dflash_eval

    assert dflash_eval.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def test_eval_answers_bad_prompts_and_bad_drafter_folders_in_one_line(capsys, tmp_path):
    from conftest import tiny_drafter, tiny_target
    from dflash.drafter.export import WEIGHTS_NAME, export_drafter

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
    eval_fails_with(capsys, ["--dtype", "float16"], "--dtype float16: use auto, float32 or bfloat16")


def test_a_truncated_target_weight_file_is_named(tmp_path):
    from conftest import tiny_causal_lm
    from dflash.target.frozen import FrozenTarget

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
               "--eval-dtype half: use auto, float32 or bfloat16")
    missing = tmp_path / "missing.jsonl"
    eval_fails_with(capsys, ["--prompts", str(missing)], f"--prompts {missing}: no such file")
    eval_fails_with(capsys, ["--num-prompts", "0"], "--num-prompts 0: use at least 1")


def test_a_config_file_with_unknown_keys_names_them_with_the_closest_flags(capsys, paths):
    run = paths["tmp"] / "run.yaml"
    run.write_text(f"target: {paths['target']}\ntrain_data: {paths['data']}\nmax_step: 10\neval-prompt: 2\nzzz: 1\n")
    fails_with(capsys, [str(run)], f"error: {run}: unknown keys 'max_step' (did you mean 'max_steps'?), "
               "'eval-prompt' (did you mean 'eval-prompts'?), 'zzz'; the keys are the flags of "
               "`python train_drafter.py --help` without their leading --")
    run.write_text("- max_steps: 10\n")
    fails_with(capsys, [str(run)], f"error: {run}: expected a mapping of flag names to values")
    run.write_text("max_steps: [10\n")
    fails_with(capsys, [str(run)], f"error: {run}: cannot read it as YAML (")


def test_a_config_file_takes_either_spelling_and_its_values_are_typed_as_flags_are(paths):
    from dflash.config import parse_config

    run = paths["tmp"] / "run.yaml"
    # PyYAML reads 1e-3 as a string; as a flag value it is a float like any other
    run.write_text(f"target: {paths['target']}\ntrain-data: {paths['data']}\nlr: 1e-3\nmax-steps: 5\n"
                   f"bucket_boundaries: [0, 64]\nepochs: null\noutput_dir: {paths['tmp'] / 'run'}\n")
    train = parse_config([str(run)]).train
    assert (train.lr, train.max_steps, train.epochs) == (1e-3, 5, 6)


def test_zero_stage_3_is_refused_at_start(capsys, paths):
    """ZeRO-3 partitions the weights: the run logged "0.0M trainable params" and exported empty tensors."""
    ds = paths["tmp"] / "zero3.json"
    ds.write_text('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}')
    fails_with(capsys, ["--target", paths["target"], "--train-data", paths["data"], "--deepspeed-config", str(ds)],
               f"--deepspeed-config {ds}: zero_optimization.stage 3 is not supported; use stage 1 or 2 "
               "(ds_configs/zero1.json, ds_configs/zero2.json)", "what ZeRO shards here is its optimizer state")


def test_a_config_without_zero_is_refused_at_start(capsys, paths):
    """Without ZeRO the engine applies a NaN gradient: the spike guard's skip (a NaN gradient the
    step skips) and a step's skipped micro-batches (ZeRO's loss scale) need stage 1 or 2."""
    ds = paths["tmp"] / "zero0.json"
    ds.write_text('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}}')
    fails_with(capsys, ["--target", paths["target"], "--train-data", paths["data"], "--deepspeed-config", str(ds)],
               f"--deepspeed-config {ds}: zero_optimization.stage 0 is not supported; use stage 1 or 2",
               "without ZeRO (stage 0) a non-finite gradient would reach the weights")


def test_periodic_checkpoints_are_on_by_default_by_time_or_as_the_flags_say(paths):
    from dflash.config import DEFAULT_SAVE_MINUTES, parse_config

    def schedule(*flags: str) -> tuple[int, float]:
        train = parse_config(["--target", paths["target"], "--train-data", paths["data"], *flags],
                             for_training=False).train
        return train.save_every, train.save_every_minutes

    assert DEFAULT_SAVE_MINUTES == 30
    assert schedule() == (0, 30.0), "a week-long run keeps a checkpoint every 30 minutes unless told otherwise"
    assert schedule("--save-every", "500") == (500, 0.0)
    assert schedule("--save-every-minutes", "5") == (0, 5.0)
    assert schedule("--save-every", "500", "--save-every-minutes", "5") == (500, 5.0)
    assert schedule("--save-every", "0") == (0, 0.0), "0 still turns them all off"


def test_a_mask_token_the_target_emits_or_reads_is_refused():
    import re

    tokenizer = make_tiny_tokenizer()
    config = tiny_causal_lm(vocab_size=len(tokenizer) + 2).config
    config.bos_token_id = 1
    for token_id, meaning, token in ((tokenizer.eos_token_id, "end-of-sequence", "<|im_end|>"),
                                     (tokenizer.pad_token_id, "padding", "<|endoftext|>"),
                                     (1, "beginning-of-sequence", "<|im_start|>")):
        with pytest.raises(TargetError, match=re.escape(f"--mask-token-id {token_id} is the {meaning} token "
                                                        f"'{token}'") + ".*pick an id the target never emits"):
            resolve_mask_token_id(tokenizer, config, token_id)


def test_the_decode_benchmark_needs_a_plain_prompt_to_compare_with(capsys, paths):
    from dflash.benchmarks import decode

    with pytest.raises(SystemExit) as exit_info:
        decode.main(["--target", paths["target"], "--prompts", paths["data"], "--plain-prompts", "0"])
    assert exit_info.value.code == 2
    assert "--plain-prompts 0: use 1..--num-prompts (16)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        decode.main(["--target", paths["target"], "--prompts", paths["data"], "--draft-layers", "0"])
    assert exit_info.value.code == 2
    assert "--draft-layers 0: use 1 or more" in capsys.readouterr().err


def test_the_decoding_benchmarks_name_a_prompts_file_they_cannot_open(capsys, tmp_path):
    from dflash.benchmarks import decode, target_confidence
    from dflash.demo import DEMO_TARGET_DIR

    missing = tmp_path / "missing.jsonl"
    for main in (decode.main, target_confidence.main):
        assert main(["--target", str(DEMO_TARGET_DIR), "--prompts", str(missing), "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert f"error: {missing}: cannot open the data file" in err and "Traceback" not in err


def test_running_out_of_gpu_memory_names_the_flags_that_size_a_step(tiny_setup, tmp_path, capfd, monkeypatch):
    """An out-of-memory mid-run ends in one line that names the step-sizing flags and how to go on."""
    import dflash.training.run as run
    from conftest import tiny_args

    def out_of_memory(config, ranks):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 768.00 MiB. GPU 0 has ...\nmore")

    monkeypatch.setattr(run, "train", out_of_memory)
    assert train_drafter.main(tiny_args(tiny_setup, tmp_path / "run", "--kl-weight", "1")) == 1
    err = capfd.readouterr().err
    lines = [line.split("ERROR dflash.train: ")[-1] for line in err.splitlines() if "out of GPU memory" in line]
    assert "Traceback" not in err
    assert lines == ["rank 0: out of GPU memory (CUDA out of memory. Tried to allocate 768.00 MiB. GPU 0 has ...); "
                     "a step's size is set by --max-tokens 256 (padded tokens per micro-batch), --max-draft-positions "
                     "set by the memory model and --max-anchors 8, "
                     "with --kl-weight 1.0 (the target's final hidden states travel too): lower them; no checkpoint "
                     "was saved (one is kept every --save-every-minutes M, or --save-every N steps): start again "
                     "with the same command plus --overwrite"]



def test_a_tokenizer_of_another_model_stops_training_before_set_up(tiny_setup, tmp_path, capfd):
    """Another model's tokenizer trained silently: its ids index the target's rows all the same."""
    from conftest import tiny_args
    from dflash.demo import DEMO_TARGET_DIR
    from tiny_tokenizer import _MERGED_WORDS

    target = tiny_setup["target"]
    assert train_drafter.main(tiny_args(tiny_setup, tmp_path / "a", "--tokenizer", str(DEMO_TARGET_DIR))) == 2
    err = capfd.readouterr().err
    assert (f"--tokenizer {DEMO_TARGET_DIR} and --target {target} do not belong together: size: --tokenizer has "
            "4096 tokens, more than the target's 328 embedding rows (its config's vocab_size)") in err, err
    assert "no flag overrides the size check" in err and "Traceback" not in err
    other = tmp_path / "other-tokenizer"
    make_tiny_tokenizer(words=_MERGED_WORDS[::-1]).save_pretrained(other)  # same size and special tokens
    assert train_drafter.main(tiny_args(tiny_setup, tmp_path / "b", "--tokenizer", str(other))) == 2
    err = capfd.readouterr().err
    assert "vocabulary: 65 of the first 325 ids name other tokens than in the tokenizer the target ships" in err, err
    assert "or pass --allow-tokenizer-mismatch if the difference is deliberate" in err and "Traceback" not in err
    assert not (tmp_path / "b" / "data").exists()  # refused before any data was tokenized


def test_the_data_tools_eval_and_regenerate_refuse_a_tokenizer_of_another_model(tiny_setup, tmp_path, capsys):
    from dflash.tools.data import main as data_main
    from dflash.data.regenerate import main as regenerate_main
    from dflash.eval.__main__ import main as eval_main
    from tiny_tokenizer import _MERGED_WORDS

    other = tmp_path / "other-tokenizer"
    make_tiny_tokenizer(words=_MERGED_WORDS[::-1]).save_pretrained(other)
    pair = ["--target", str(tiny_setup["target"]), "--tokenizer", str(other)]
    for main, argv in ((data_main, ["stats", *pair, "--train-data", str(tiny_setup["train"]),
                                    "--output-dir", str(tmp_path / "run")]),
                       (eval_main, [*pair, "--prompts", str(tiny_setup["heldout"])]),
                       (regenerate_main, [*pair, "--prompts", str(tiny_setup["heldout"]),
                                          "--output", str(tmp_path / "regen.jsonl")])):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "Traceback" not in err, err
        assert "vocabulary: 65 of the first 325 ids" in err and "--allow-tokenizer-mismatch" in err, err
