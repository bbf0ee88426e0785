"""Typed run configuration, parsed from CLI flags or a JSON/YAML file by HfArgumentParser.

Fields left at None take a preset's value (`--preset`): the published DFlash recipe, the small-target
preset (a cheaper drafter step, for targets whose own forward is cheap), or the demo preset when no
`--target` is given (the shipped demo target and data, sized to finish in minutes on a laptop CPU).
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import yaml
from transformers import HfArgumentParser

from dflash.data.chat_formats import load_chat_jsonl
from dflash.data.prepare import CUT_REPLY_POLICIES, DEFAULT_CUT_REPLIES
from dflash.data.thinking import THINKING_FLAG_VALUES, THINKING_HELP
from dflash.demo import DEMO_HELDOUT_DATA, DEMO_TARGET_DIR, DEMO_TRAIN_DATA, require_demo_assets
from dflash.target.gguf import is_model_path
from dflash.util.cli import ConfigError, cli_parser, without_launcher_flags
from dflash.util.files import output_dir_problem

DEFAULT_BUCKETS = [0, 770, 1216, 1728, 2432, 3296, 8192]
DEFAULT_SAVE_MINUTES = 30.0  # a week-long run keeps a checkpoint this often unless told otherwise


@dataclass
class ModelArgs:
    target: str | None = field(default=None, metadata={"help": "HF causal-LM folder, or a .gguf file (de-quantized once into <output-dir>/target-hf) (default: the shipped demo target)"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer folder with a chat template, or a .gguf file (default: --target)"})
    preset: str = field(default="auto", metadata={"help": "the defaults of the flags left unset: recipe (the published DFlash recipe, targets of about 4B and up) | small (3 drafter layers, B=8, 128 anchors, a 32,768-token draft vocabulary, cut replies kept: targets of up to about 2B, such as Qwen2.5-Coder-0.5B) | demo; auto: demo for the shipped demo target, else recipe"})
    num_draft_layers: int | None = field(default=None, metadata={"help": "drafter layers (recipe 5, small 3, demo 3)"})
    target_layer_ids: list[int] | None = field(default=None, metadata={"help": "target layers whose outputs feed the drafter"})
    num_target_features: int | None = field(default=None, metadata={
        "help": "K, when --target-layer-ids is not given (recipe 5, demo 4)"})
    init_from_target_layers: list[int] | None = field(default=None, metadata={
        "help": "start drafter layer i as a copy of target layer i of this list (one per drafter layer; default: random)"})
    block_size: int | None = field(default=None, metadata={"help": "B, tokens drafted per forward (recipe 16, demo 8)"})
    draft_window: int = field(default=0, metadata={"help": "sliding window of the drafter's layers: a block sees the W context positions before its anchor (0: all)"})
    draft_vocab: int | None = field(default=None, metadata={"help": "N > 0: the drafter drafts from the N tokens most frequent in the training replies, through those rows of the target's lm_head, a fraction of its cost on a small target with a large vocabulary (0: every token; recipe 0, small 32768)"})
    mask_token_id: int | None = field(default=None, metadata={"help": "default: tokenizer mask token, else a spare embedding row (a GGUF's first [PAD<row>] placeholder, else the first row past the tokenizer)"})
    allow_tokenizer_mismatch: bool = field(default=False, metadata={
        "help": "train although --tokenizer's special ids or vocabulary differ from --target's (a warning, not an error)"})
    attention_backend: str = field(default="auto", metadata={"help": "auto | sdpa | flex"})
    kernels: str = field(default="fast", metadata={"help": "fast (flex attention, fused lm_head loss, compiled layers on GPU) | naive (dense SDPA mask, full logits, eager: the reference the benchmark compares with)"})
    target_forward: str = field(default="auto", metadata={"help": "the target's forward that computes the features: auto (packed where it applies: targets without sliding windows, no --target-length-groups; else hf) | hf (its own layers; with --kernels fast on a GPU, their MLPs and norms compiled) | decoder (the fast decoder's layer functions: stacked projections, its RoPE, compiled for every shape on a GPU; Llama, Mistral, Qwen2/3 without sliding windows) | packed (HF's layers over the micro-batch's real tokens only, its rows packed into one sequence, FlashAttention's variable-length kernel on a GPU: no padded position is computed; targets without sliding windows); dflash.benchmarks.target_forward compares them"})


@dataclass
class DataArgs:
    train_data: str | None = field(default=None, metadata={"help": "chat JSONL (default: demo data)"})
    eval_data: str | None = field(default=None, metadata={"help": "held-out chat JSONL for the final evaluation"})
    max_length: int | None = field(default=None, metadata={"help": "tokens per sequence (recipe 3072, demo 512)"})
    overflow: str = field(default="truncate", metadata={"help": "longer sequences: truncate | drop"})
    loss_turns: str = field(default="last", metadata={"help": "assistant turns in the loss: last (the reply the target regenerated; earlier replies of a multi-turn prompt are the dataset's) | all (each rendered as serving renders it)"})
    thinking: str = field(default="auto", metadata={"help": THINKING_HELP})
    cut_replies: str | None = field(default=None, metadata={"help": "replies the regeneration cut at its length limit (target_reply.finish_reason length): drop (left out, counted in the shard's manifest; recipe, demo) | keep (trained as cut, never closed by an end-of-turn token; small)"})
    on_bad_sample: str = field(default="skip", metadata={"help": "skip (counted, listed in <output-dir>/data/train/bad_samples.txt) | error"})
    max_bad_fraction: float = field(default=0.01, metadata={"help": "with skip: more bad samples than this fraction stops the run"})
    bucket_boundaries: list[int] = field(default_factory=lambda: list(DEFAULT_BUCKETS))
    max_tokens: int | None = field(default=None, metadata={"help": "padded tokens per micro-batch (recipe 8192, demo 2048)"})
    group_by_length: bool = field(default=False, metadata={"help": "micro-batches of samples of about one length: a bucket's shuffled samples are sorted by length in chunks of 1,024 before they are cut, and the micro-batches shuffled. Fewer padded tokens (on 27,274 Qwen2.5-Coder-0.5B replies 97%% of them real, against 72%%), but on the demo each step taught less (tau 4.16 against 4.61 after the same 899 steps, in 235 s against 302): off by default"})
    target_length_groups: int = field(default=1, metadata={"help": "N > 1: the target runs each micro-batch as up to N groups of rows of about one length, each padded to its own longest, and the drafter trains on the whole micro-batch as drawn. On 39,081 Qwen2.5-Coder-0.5B replies at --max-tokens 32768, 4 groups compute 27%% fewer positions (88%% of them real, against 64%%): 36%% more real tokens/s on a CPU, but on an H100 a step took 6%% longer (150.6 against 142.2 ms, the same micro-batches), so 1 (one forward over the padded micro-batch) is the default"})
    prepare_workers: int = field(default=0, metadata={"help": "processes tokenizing the data (0: the usable cores, up to 16, for files of 8 MB and more, else 1)"})
    cache_target_features: bool | None = field(default=None, metadata={
        "help": "keep each sample's target features after its first epoch, so later epochs skip the target's forward; memory: every token's features (recipe off, demo on)"})
    reuse_features: int = field(default=1, metadata={"help": "N > 1: each micro-batch's target features serve N optimizer steps in a row, echo k taking the next --max-anchors anchors along the first step's random order (data echoing): the target runs once per N steps and an epoch takes N times the steps; can pay only where the target's forward is a large share of a step (the training log's FLOP model gives it); on Qwen2.5-Coder-0.5B N=2 lost held-out tau at equal GPU time (BENCHMARKS.md)"})
    max_draft_positions: int | None = field(default=None, metadata={"help": "padded draft positions (anchors x B) per micro-batch; default: from the memory model on a GPU, no limit on CPU; 0: no limit"})


@dataclass
class TrainArgs:
    output_dir: str = field(default="runs/demo")
    deepspeed_config: str | None = field(default=None, metadata={"help": "DeepSpeed JSON (default: ZeRO-1 as in ds_configs/zero1.json on GPU, cpu.json on CPU)"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda"})
    precision: str = field(default="auto", metadata={"help": "auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32"})
    target_ranks: str = field(default="colocated", metadata={"help": "colocated | auto | T (ranks running the target)"})
    credits: int = field(default=4, metadata={"help": "split mode: feature requests in flight per drafter/target pair"})
    dist_timeout_minutes: float = field(default=60.0, metadata={"help": "a collective (e.g. waiting while rank 0 tokenizes the data) that waits longer fails"})
    transport_timeout_s: float = field(default=300.0, metadata={"help": "split mode: a peer silent this long ends the run"})
    epochs: int | None = field(default=None, metadata={"help": "recipe 6, demo 4"})
    max_steps: int = field(default=-1, metadata={"help": "stop after this many optimizer steps (-1: all epochs)"})
    max_minutes: float | None = field(default=None, metadata={"help": "train for this many minutes (steps, periodic evals and checkpoints; not set-up or the final eval): the steps that fit are estimated as the run goes and the LR curve spread over them; --epochs and --max-steps still cap the run"})
    lr: float = field(default=6e-4, metadata={"help": "peak learning rate (AdamW; with Muon, of the 1-D weights)"})
    optimizer: str = field(default="adamw", metadata={"help": "adamw | muon (DeepSpeed's Muon for the 2-D weights, AdamW for the rest)"})
    muon_lr: float = field(default=0.2, metadata={"help": "--optimizer muon: peak learning rate of the 2-D weights (spectral norm per step)"})
    warmup_ratio: float = field(default=0.04, metadata={"help": "share of the steps the learning rate warms up over (see --min-warmup-steps)"})
    min_warmup_steps: int = field(default=40, metadata={"help": "the learning rate rises no faster than a linear warmup over this many steps (at most half the run), whatever --warmup-ratio or --max-minutes make of the curve: 2 / (1 - AdamW's beta2 of 0.95), the steps its second moments take to settle (0: the ratio alone)"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW's decoupled weight decay, on the drafter's weight matrices only (its norms' gains are not decayed)"})
    grad_clip: float = 1.0
    grad_accum: int = 1
    max_anchors: int | None = field(default=None, metadata={"help": "A, anchors per sequence (recipe 512, demo 16)"})
    gamma: float | None = field(default=None, metadata={"help": "slot-weight decay (default 7 for B=16, 5 for B=10, 4 for B=8)"})
    slot_weights: str = field(default="decay", metadata={"help": "decay (exp(-(j-1)/gamma)) | uniform"})
    loss: str = field(default="dpace", metadata={"help": "dpace (D-PACE-weighted CE) | ce (slot-weighted CE) | ce+dpace"})
    dpace_alpha: float = field(default=0.5, metadata={"help": "D-PACE confidence smoothing, in (0, 1]"})
    dpace_weight: float = field(default=1.0, metadata={"help": "weight of the D-PACE term in --loss ce+dpace"})
    anchors: str = field(default="random", metadata={"help": "random (anchors drawn among response positions) | stride (blocks B apart, an ablation)"})
    zero_features: bool = field(default=False, metadata={"help": "feed the drafter zeros for the target's features (a control for ablations)"})
    lr_schedule: str = field(default="wsd", metadata={"help": "wsd (warmup, stable, linear to 0 over the last --decay-ratio) | cosine (warmup, cosine to 0; the published recipe)"})
    decay_ratio: float = field(default=0.2, metadata={"help": "wsd: share of the steps spent decaying"})
    kl_weight: float = field(default=0.0, metadata={"help": "weight of the KL to the target distribution (0: off)"})
    feature_noise_std: float = field(default=0.0, metadata={"help": "initial std of feature noise, cosine-decayed to 0"})
    seed: int = 0
    log_every: int = 10
    profile_steps: int = field(default=0, metadata={"help": "profile this many optimizer steps after the first 20 (GPU): <output-dir>/profile/"})
    profile_host: bool = field(default=False, metadata={"help": "with --profile-steps: record the host's ops too, and name the op the host was in while the GPU waited (the profiler's own work widens the gaps)"})
    spike_factor: float = field(default=3.0, metadata={"help": "skip a micro-batch whose loss exceeds this x the running mean (0: only NaN/inf)"})
    save_every: int | None = field(default=None, metadata={"help": "checkpoint every N optimizer steps (default: by time, see --save-every-minutes; 0: no periodic checkpoints at all)"})
    save_every_minutes: float | None = field(default=None, metadata={"help": f"checkpoint every M minutes of training (default {DEFAULT_SAVE_MINUTES:g}, unless --save-every N is given; both: whichever comes first)"})
    keep_checkpoints: int = field(default=3, metadata={"help": "keep the newest N complete checkpoints"})
    resume: bool = field(default=False, metadata={"help": "continue from the newest complete checkpoint in --output-dir"})
    overwrite: bool = field(default=False, metadata={"help": "start afresh in an --output-dir that holds an earlier run (its metrics, checkpoints and drafters are deleted)"})
    report_to: str = field(default="wandb", metadata={"help": "wandb | none (metrics.jsonl is always written)"})
    wandb_mode: str = field(default="offline", metadata={"help": "offline (no account needed) | online | disabled"})
    eval_prompts: int = field(default=16, metadata={"help": "held-out prompts decoded at the end (0: skip)"})
    eval_max_new_tokens: int = 96
    eval_every: int = field(default=200, metadata={"help": "exact teacher-forced tau on the held-out prompts every N optimizer steps (0: off)"})
    eval_dtype: str = field(default="auto", metadata={"help": "the final eval's: auto (bfloat16 on a GPU, as served; float32 on the CPU) | float32 (the exact lossless check on every prompt) | bfloat16"})
    final_eval: bool = field(default=True, metadata={"help": "decode the held-out prompts with the untrained and the trained drafter at the end (false: only the periodic exact tau, whose last one is taken at the last step: probes at equal GPU time)"})
    eval_lossless_prompts: int = field(default=4, metadata={"help": "when the final eval is not float32, the trained drafter also decodes this many of its prompts in float32, where speculative decoding must equal greedy exactly (0: skip)"})


RECIPE = {"num_draft_layers": 5, "num_target_features": 5, "block_size": 16, "epochs": 6, "max_anchors": 512,
          "max_length": 3072, "max_tokens": 8192, "cache_target_features": False, "draft_vocab": 0,
          "cut_replies": DEFAULT_CUT_REPLIES}
# Targets of up to about 2B parameters: their own forward is cheap, so the drafter's step decides how
# many steps a GPU-minute buys. 8 tokens a block, 128 anchors and the 32,768 most frequent reply tokens
# (98.8% of Qwen2.5-Coder-0.5B's) make the step about a third of the recipe's; such runs go through
# their replies several times, so the third of them cut at the length limit are kept as more data
# (BENCHMARKS.md "Qwen2.5-Coder-0.5B": tau 2.77 at 128 tokens after 13 minutes). Three drafter layers
# learned as much per GPU-minute as five in probes sharing one GPU, and their decode cycle costs 1.26
# greedy steps against 1.38 (BENCHMARKS.md "Recipe probes at equal GPU time"); alone on the GPU, five
# (15.3 minutes) drafted 0.10 more tau at 128 tokens than three (13) but decoded 1.97x against 2.07x.
SMALL = {**RECIPE, "num_draft_layers": 3, "block_size": 8, "max_anchors": 128, "draft_vocab": 32768,
         "cut_replies": "keep"}
# The demo runs on a laptop CPU, where verifying B tokens costs more than one token's arithmetic
# (a GPU verifies 16 for the price of one), so it drafts 8. Copying text, as the demo target does,
# takes a drafter of 3 layers a few epochs to learn; 4 fit the demo's ten minutes (BENCHMARKS.md
# "The demo's drafter").
DEMO = {"num_draft_layers": 3, "num_target_features": 4, "block_size": 8, "epochs": 4, "max_anchors": 16,
        "max_length": 512, "max_tokens": 2048, "cache_target_features": True, "draft_vocab": 0,
        "cut_replies": DEFAULT_CUT_REPLIES}
PRESETS = {"recipe": RECIPE, "small": SMALL, "demo": DEMO}


@dataclass
class RunConfig:
    model: ModelArgs
    data: DataArgs
    train: TrainArgs

    @property
    def is_demo(self) -> bool:
        return self.model.target is None or Path(self.model.target).resolve() == DEMO_TARGET_DIR.resolve()


def parse_config(argv: list[str] | None = None, for_training: bool = True) -> RunConfig:
    """Flags, or a single .json/.yaml file holding the same names. `for_training=False`
    (the data tools) leaves out the checks about an earlier run in --output-dir."""
    argv = without_launcher_flags(sys.argv[1:] if argv is None else argv)
    parser = cli_parser((ModelArgs, DataArgs, TrainArgs))
    if len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")):
        argv = flags_from_file(argv[0], parser)
    model, data, train = parser.parse_args_into_dataclasses(argv)
    config = RunConfig(model, data, train)
    fill_defaults(config)
    validate(config, for_training)
    return config


def flags_from_file(path: str, parser: HfArgumentParser) -> list[str]:
    """A .json/.yaml file's keys and values as the flags they name (`max_steps: 10` or `max-steps: 10`
    -> `--max-steps=10`), so that they are typed and checked as on the command line; null keeps
    the default. Unknown keys are an error naming each with the closest flag."""
    kind = "JSON" if path.endswith(".json") else "YAML"
    try:
        text = Path(path).read_text()
        values = json.loads(text) if kind == "JSON" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: cannot read it as {kind} ({err})") from err
    _require(isinstance(values, dict), f"{path}: expected a mapping of flag names to values, such as `max_steps: 100`")
    names = [f.name for dtype in parser.dataclass_types for f in fields(dtype)]

    def named(key: str) -> str:
        close = difflib.get_close_matches(key.replace("-", "_"), names, n=1)
        if not close:
            return f"'{key}'"
        return f"'{key}' (did you mean '{close[0].replace('_', '-') if '-' in key else close[0]}'?)"

    unknown = [named(str(key)) for key in values if str(key).replace("-", "_") not in names]
    _require(not unknown, f"{path}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; the keys "
             "are the flags of `python train_drafter.py --help` without their leading --")
    argv = []
    for key, value in values.items():
        flag = f"--{str(key).replace('_', '-')}"
        if isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif value is not None:
            argv.append(f"{flag}={value}")
    return argv


def fill_defaults(config: RunConfig) -> None:
    name = config.model.preset
    _require(name == "auto" or name in PRESETS, f"--preset {name}: use auto or one of {', '.join(PRESETS)}")
    preset = PRESETS[name] if name != "auto" else DEMO if config.is_demo else RECIPE
    for part in (config.model, config.data, config.train):
        for f in fields(part):
            if f.name in preset and getattr(part, f.name) is None:
                setattr(part, f.name, preset[f.name])
    if config.model.target is None:
        require_demo_assets("--target and --train-data")
        config.model.target = str(DEMO_TARGET_DIR)
        config.data.train_data = config.data.train_data or str(DEMO_TRAIN_DATA)
        config.data.eval_data = config.data.eval_data or str(DEMO_HELDOUT_DATA)
    config.model.tokenizer = config.model.tokenizer or config.model.target
    if config.data.train_data is None:
        raise ConfigError("--train-data is required with --target: pass a chat JSONL file")
    settle_checkpoint_schedule(config.train)


def settle_checkpoint_schedule(t: TrainArgs) -> None:
    """Periodic checkpoints are on unless turned off: every DEFAULT_SAVE_MINUTES by default, or
    as --save-every (steps) and --save-every-minutes say; --save-every 0 turns them all off. After
    this, 0 in either field means that clock does not save."""
    _require(t.save_every is None or t.save_every >= 0,
             f"--save-every {t.save_every}: use a positive step count, or 0 for no periodic checkpoints")
    _require(t.save_every_minutes is None or (math.isfinite(t.save_every_minutes) and t.save_every_minutes > 0),
             f"--save-every-minutes {t.save_every_minutes}: use a positive number of minutes (--save-every 0 turns "
             "periodic checkpoints off)")
    _require(t.save_every != 0 or t.save_every_minutes is None,
             f"--save-every 0 turns periodic checkpoints off, --save-every-minutes {t.save_every_minutes} asks for "
             "them: pass one of the two")
    if t.save_every_minutes is None:
        t.save_every_minutes = DEFAULT_SAVE_MINUTES if t.save_every is None else 0.0
    if t.save_every is None:
        t.save_every = 0


RUN_CONFIG_FILE = "run_config.json"  # the flags a run ran with, --thinking resolved
RUN_FILES = ("metrics.jsonl", "target_metrics", "checkpoints", "drafter", "drafter-init", "eval.json", RUN_CONFIG_FILE)


def earlier_run_files(output_dir: Path) -> list[str]:
    """What an earlier run left in output_dir (the prepared data is not a run: it is reused)."""
    return [name for name in RUN_FILES if (output_dir / name).exists()]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


# What a resumed run must share with its checkpoint besides the data and batching (the sampler
# checks those): the objective, the optimizer, the LR curve and the run's length. The checkpoint's
# scheduler state would silently replace a changed --lr and keep its own end step (a changed
# --epochs or --max-steps); a changed loss would train another objective.
RECIPE_FLAGS = ("loss", "dpace_alpha", "dpace_weight", "slot_weights", "gamma", "anchors", "zero_features",
                "kl_weight", "feature_noise_std", "optimizer", "lr", "muon_lr", "weight_decay", "grad_clip",
                "lr_schedule", "warmup_ratio", "min_warmup_steps", "decay_ratio", "epochs", "max_steps", "max_minutes")


def recipe_settings(t: TrainArgs) -> dict:
    """The recipe flags as a checkpoint records them."""
    return {name: getattr(t, name) for name in RECIPE_FLAGS}


def check_resumed_recipe(saved: dict, t: TrainArgs, checkpoint: Path) -> None:
    """ConfigError naming every recipe flag that differs from the checkpoint's (`saved`; flags it
    does not record are not compared)."""
    changed = [f"--{name.replace('_', '-')} {now!r} (the checkpoint: {saved[name]!r})"
               for name, now in recipe_settings(t).items() if name in saved and saved[name] != now]
    _require(not changed, f"--resume from {checkpoint}: {'; '.join(changed)}. Pass the checkpoint's values to "
             "continue that run, or start afresh with --overwrite instead of --resume")


TRAIN_EVAL_FLAGS = {"prompts": "--eval-data", "num": "--eval-prompts", "tokens": "--eval-max-new-tokens",
                    "dtype": "--eval-dtype"}
EVAL_FLAGS = {"prompts": "--prompts", "num": "--num-prompts", "tokens": "--max-new-tokens", "dtype": "--dtype"}


def check_eval_flags(prompts: str | None, num_prompts: int, max_new_tokens: int, dtype: str,
                     names: dict[str, str], min_prompts: int) -> None:
    """The evaluation checks `train_drafter.py --eval-*` and `python -m dflash.eval` share, each
    flag named as its own command spells it; the prompt file is read now (a bad file found after
    a day of training costs the day's evaluation)."""
    _require(num_prompts >= min_prompts, f"{names['num']} {num_prompts}: use at least {min_prompts}")
    _require(max_new_tokens >= 1, f"{names['tokens']} {max_new_tokens}: use at least 1")
    _require(dtype in ("auto", "float32", "bfloat16"), f"{names['dtype']} {dtype}: use auto, float32 or bfloat16")
    if prompts is not None and num_prompts > 0:
        _require(Path(prompts).is_file(), f"{names['prompts']} {prompts}: no such file; pass a chat JSONL file")
        load_chat_jsonl(prompts, require_reply=False)


def validate_recipe(t: TrainArgs) -> None:
    """The objective, optimizer and schedule flags."""
    _require(t.slot_weights in ("decay", "uniform"), f"--slot-weights {t.slot_weights}: use decay or uniform")
    _require(t.loss in ("ce", "dpace", "ce+dpace"), f"--loss {t.loss}: use ce, dpace or ce+dpace")
    _require(0 < t.dpace_alpha <= 1, f"--dpace-alpha {t.dpace_alpha}: use a smoothing in (0, 1] (0.5 in the paper)")
    _require(math.isfinite(t.dpace_weight) and t.dpace_weight > 0, f"--dpace-weight {t.dpace_weight}: use > 0")
    _require(t.anchors in ("random", "stride"), f"--anchors {t.anchors}: use random or stride")
    _require(t.optimizer in ("adamw", "muon"), f"--optimizer {t.optimizer}: use adamw or muon")
    _require(math.isfinite(t.muon_lr) and t.muon_lr > 0, f"--muon-lr {t.muon_lr}: use a positive learning rate")
    _require(t.lr_schedule in ("cosine", "wsd"), f"--lr-schedule {t.lr_schedule}: use cosine or wsd")
    _require(0 < t.decay_ratio <= 1 and t.warmup_ratio + t.decay_ratio <= 1,
             f"--decay-ratio {t.decay_ratio}: use a fraction in (0, 1] that leaves room for --warmup-ratio {t.warmup_ratio}")
    check_no_ignored_flags(t)


def check_no_ignored_flags(t: TrainArgs) -> None:
    """A knob the chosen recipe does not use is an error, not a silent no-op (a default value passes)."""
    # D-PACE weighs slots by itself: the slot weights shape only the CE and KL terms
    _require(t.loss != "dpace" or t.kl_weight > 0 or (t.gamma is None and t.slot_weights == "decay"),
             f"--gamma / --slot-weights {t.slot_weights}: no effect with --loss dpace (it weighs slots itself); "
             "use --loss ce or ce+dpace, or leave them out")
    defaults = TrainArgs()
    users = {"muon_lr": (t.optimizer == "muon", "--optimizer muon"),
             "dpace_alpha": (t.loss != "ce", "--loss dpace or ce+dpace"),
             "dpace_weight": (t.loss == "ce+dpace", "--loss ce+dpace"),
             "decay_ratio": (t.lr_schedule == "wsd", "--lr-schedule wsd")}
    for name, (used, by) in users.items():
        _require(used or getattr(t, name) == getattr(defaults, name),
                 f"--{name.replace('_', '-')} {getattr(t, name)}: only {by} uses it; add that or leave it out")


def check_deepspeed_config(path: str) -> None:
    """A JSON object whose ZeRO stage keeps the drafter's weights whole on every rank and skips an
    update whose gradient is not finite: stage 1 or 2. Stage 3 partitions the weights themselves
    (the run would train and export empty tensors); without ZeRO the engine applies a NaN gradient,
    and both the spike guard (dflash/training/spike.py poisoned) and gradient accumulation's
    skipped micro-batches (gradient_scaled, ZeRO's loss scale) rely on that skip."""
    try:
        ds = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"--deepspeed-config {path}: cannot read it as JSON ({err})") from err
    _require(isinstance(ds, dict), f"--deepspeed-config {path}: expected a JSON object of DeepSpeed settings")
    zero = ds.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0  # DeepSpeed names a malformed section itself
    _require(stage in (1, 2),
             f"--deepspeed-config {path}: zero_optimization.stage {stage!r} is not supported; use stage 1 or 2 "
             "(ds_configs/zero1.json, ds_configs/zero2.json). The drafter is small: what ZeRO shards here is its "
             "optimizer state (stage 1) and gradients (stage 2), while every rank keeps the whole drafter; without "
             "ZeRO (stage 0) a non-finite gradient would reach the weights instead of skipping the step")


def validate(config: RunConfig, for_training: bool = True) -> None:
    """Checks that need no model or data: they fail in a second, not after loading."""
    _validate_inputs_and_shapes(config)
    _validate_run(config.train, for_training)
    _validate_optimization(config.train)
    _validate_output(config.train, for_training)


def _validate_inputs_and_shapes(config: RunConfig) -> None:
    """The model, data and eval flags, and the sizes of a block, a sequence and a micro-batch."""
    m, d, t = config.model, config.data, config.train
    _require(is_model_path(m.target),
             f"--target {m.target}: no such folder or .gguf file; pass a local HF model folder or a GGUF file")
    _require(is_model_path(m.tokenizer), f"--tokenizer {m.tokenizer}: no such folder or .gguf file")
    _require(Path(d.train_data).is_file(), f"--train-data {d.train_data}: no such file; pass a chat JSONL file")
    check_eval_flags(d.eval_data, t.eval_prompts, t.eval_max_new_tokens, t.eval_dtype, TRAIN_EVAL_FLAGS, min_prompts=0)
    _require(t.eval_lossless_prompts >= 0, f"--eval-lossless-prompts {t.eval_lossless_prompts}: use 0 (skip) or more")
    _require(d.overflow in ("truncate", "drop"), f"--overflow {d.overflow}: use truncate or drop")
    _require(d.on_bad_sample in ("skip", "error"), f"--on-bad-sample {d.on_bad_sample}: use skip or error")
    _require(d.loss_turns in ("last", "all"), f"--loss-turns {d.loss_turns}: use last or all")
    _require(d.thinking in THINKING_FLAG_VALUES, f"--thinking {d.thinking}: use {', '.join(THINKING_FLAG_VALUES)}")
    _require(d.cut_replies in CUT_REPLY_POLICIES, f"--cut-replies {d.cut_replies}: use {' or '.join(CUT_REPLY_POLICIES)}")
    _require(d.prepare_workers >= 0, f"--prepare-workers {d.prepare_workers}: use 0 (auto) or a process count")
    _require(0 <= d.max_bad_fraction <= 1, f"--max-bad-fraction {d.max_bad_fraction}: use a fraction in [0, 1]")
    _require(m.num_draft_layers >= 1, f"--num-draft-layers {m.num_draft_layers}: need at least 1")
    _require(m.init_from_target_layers is None or len(m.init_from_target_layers) == m.num_draft_layers,
             f"--init-from-target-layers {m.init_from_target_layers}: give one target layer per drafter layer "
             f"(--num-draft-layers {m.num_draft_layers})")
    _require(2 <= m.block_size <= d.max_length,
             f"--block-size {m.block_size}: need 2 <= block size <= --max-length ({d.max_length})")
    _require(t.max_anchors >= 1, f"--max-anchors {t.max_anchors}: need at least one anchor per sequence")
    _require(d.reuse_features >= 1, f"--reuse-features {d.reuse_features}: use 1 (each micro-batch's features once) "
             "or more")
    _require(d.max_tokens >= d.max_length,
             f"--max-tokens {d.max_tokens}: a micro-batch must hold one full sequence (--max-length {d.max_length})")
    _require(d.max_draft_positions is None or d.max_draft_positions == 0
             or d.max_draft_positions >= t.max_anchors * m.block_size,
             f"--max-draft-positions {d.max_draft_positions}: a micro-batch must hold one sequence's "
             f"--max-anchors x --block-size = {t.max_anchors * m.block_size} (or 0: no limit)")
    _require(m.attention_backend in ("auto", "sdpa", "flex"),
             f"--attention-backend {m.attention_backend}: use auto, sdpa or flex")
    _require(m.draft_window >= 0, f"--draft-window {m.draft_window}: use 0 (full attention) or a window in tokens")
    _require(m.draft_vocab >= 0, f"--draft-vocab {m.draft_vocab}: use 0 (every token) or a number of tokens")
    _require(m.kernels in ("fast", "naive"), f"--kernels {m.kernels}: use fast or naive")
    _require(m.target_forward in ("auto", "hf", "decoder", "packed"),
             f"--target-forward {m.target_forward}: use auto, hf, decoder or packed")
    _require(m.target_forward != "packed" or d.target_length_groups == 1,
             f"--target-forward packed with --target-length-groups {d.target_length_groups}: packed rows compute no "
             "padding at all; drop --target-length-groups")
    _require(d.target_length_groups >= 1, f"--target-length-groups {d.target_length_groups}: use 1 (one forward over "
             "the padded micro-batch) or more")
    _require(d.bucket_boundaries == sorted(d.bucket_boundaries) and len(d.bucket_boundaries) >= 1,
             f"--bucket-boundaries {d.bucket_boundaries}: must be ascending")


def _validate_run(t: TrainArgs, for_training: bool) -> None:
    """Placement, guards, checkpoints, reporting and the device."""
    _require(t.target_ranks in ("colocated", "auto") or t.target_ranks.isdigit(),
             f"--target-ranks {t.target_ranks}: use colocated, auto, or a number of ranks")
    _require(t.spike_factor == 0 or t.spike_factor > 1, f"--spike-factor {t.spike_factor}: use 0 (NaN/inf only) or > 1")
    _require(t.keep_checkpoints >= 1, f"--keep-checkpoints {t.keep_checkpoints}: keep at least 1")
    _require(t.credits >= 1, f"--credits {t.credits}: need at least 1")
    _require(t.grad_accum >= 1, f"--grad-accum {t.grad_accum}: need at least 1")
    _require(t.report_to in ("wandb", "none"), f"--report-to {t.report_to}: use wandb or none")
    # the data tools (for_training=False) report nothing: a host without wandb may prepare the data
    _require(not for_training or t.report_to != "wandb" or t.wandb_mode == "disabled"
             or importlib.util.find_spec("wandb") is not None,
             "--report-to wandb: the wandb package is not installed in this environment; install it "
             "(pip install -r requirements.txt) or pass --report-to none (metrics.jsonl is written either way)")
    _require(t.kl_weight >= 0 and t.feature_noise_std >= 0, "--kl-weight and --feature-noise-std must be >= 0")
    _require(t.device in ("auto", "cpu", "cuda"), f"--device {t.device}: use auto, cpu or cuda")
    if t.deepspeed_config is not None:
        check_deepspeed_config(t.deepspeed_config)
    _require(t.device != "cuda" or torch.cuda.is_available(),
             "--device cuda: no CUDA device is visible on this machine; use --device cpu (or auto), or check "
             "CUDA_VISIBLE_DEVICES and the driver (nvidia-smi)")


def _validate_optimization(t: TrainArgs) -> None:
    """Precision, the optimizer and schedule, and how long the run is."""
    _require(t.precision in ("auto", "bf16", "fp32"), f"--precision {t.precision}: use auto, bf16 or fp32")
    _require(math.isfinite(t.lr) and t.lr > 0, f"--lr {t.lr}: use a positive learning rate (recipe 6e-4)")
    _require(0 <= t.warmup_ratio < 1, f"--warmup-ratio {t.warmup_ratio}: use a fraction in [0, 1)")
    _require(t.min_warmup_steps >= 0, f"--min-warmup-steps {t.min_warmup_steps}: use 0 or more steps")
    _require(math.isfinite(t.weight_decay) and t.weight_decay >= 0, f"--weight-decay {t.weight_decay}: use >= 0")
    _require(math.isfinite(t.grad_clip) and t.grad_clip > 0, f"--grad-clip {t.grad_clip}: use a positive norm")
    _require(t.gamma is None or (math.isfinite(t.gamma) and t.gamma > 0),
             f"--gamma {t.gamma}: use a positive decay, or leave it out for the block size's default")
    validate_recipe(t)
    _require(t.epochs >= 1, f"--epochs {t.epochs}: need at least 1 (a run of 0 epochs would export an untrained drafter)")
    _require(t.max_steps == -1 or t.max_steps >= 1, f"--max-steps {t.max_steps}: use -1 (all epochs) or >= 1")
    _require(t.max_minutes is None or (math.isfinite(t.max_minutes) and t.max_minutes > 0),
             f"--max-minutes {t.max_minutes}: use a positive number of minutes")
    _require(t.log_every >= 1, f"--log-every {t.log_every}: need at least 1")
    _require(t.eval_every >= 0, f"--eval-every {t.eval_every}: use 0 (off) or a step count")
    _require(t.profile_steps >= 0, f"--profile-steps {t.profile_steps}: use 0 (off) or a step count")
    _require(not t.profile_host or t.profile_steps > 0, "--profile-host records the host inside the --profile-steps "
             "window: give --profile-steps N too")


def _validate_output(t: TrainArgs, for_training: bool) -> None:
    """Timeouts, resume or overwrite, and an --output-dir this run may write."""
    _require(t.transport_timeout_s > 0 and t.dist_timeout_minutes > 0,
             "--transport-timeout-s and --dist-timeout-minutes must be > 0")
    _require(not (t.resume and t.overwrite), "--resume and --overwrite exclude each other: continue the run, or start afresh")
    earlier = earlier_run_files(Path(t.output_dir)) if for_training else []
    _require(not earlier or t.resume or t.overwrite,
             f"--output-dir {t.output_dir} holds an earlier run ({', '.join(earlier)}): pass --resume to continue it, "
             "--overwrite to start afresh there, or another --output-dir")
    problem = output_dir_problem(Path(t.output_dir))
    _require(problem is None, f"--output-dir {t.output_dir} {problem}: pass a folder you can write to")
