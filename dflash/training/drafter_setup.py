"""Everything a drafter rank builds before its first step: the DeepSpeed engine over the drafter
ranks, the rank-aware sampler with its budgets, the drafter step with its kernels, the LR
schedule, the checkpointer, the spike guard and step tally, and the resume from the newest
checkpoint."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash.config import RunConfig, check_resumed_recipe, recipe_settings
from dflash.data.dataset import TokenDataset
from dflash.data.sampler import RankAwareBucketSampler
from dflash.drafter.attention import resolve_backend
from dflash.drafter.export import export_drafter
from dflash.drafter.init_from_target import init_from_target_layers
from dflash.drafter.model import DFlashDrafter, head_vocab_size
from dflash.drafter.objective import LossTerms, default_gamma, slot_weights
from dflash.drafter.step import DrafterStep, StepSettings
from dflash.drafter.vocab import choose_draft_vocabulary, coverage
from dflash.eval.periodic import ProbeSequences
from dflash.placement.distributed import RankInfo
from dflash.placement.topology import DrafterParallelism, Topology
from dflash.target.frozen import FrozenTarget
from dflash.training.budget import TimeBudget
from dflash.training.checkpoint import (Checkpointer, CheckpointError, checkpoint_dir, load_checkpoint,
                                        newest_intact_checkpoint, saved_batching, saved_drafter_ranks, saved_recipe)
from dflash.training.memory import MemoryBudgetError, MemoryShapes, draft_position_budget, free_device_bytes
from dflash.training.schedules import ADAM_BETAS, LRSchedule, planned_total_steps
from dflash.training.spike import SpikeGuard, StepTally
from dflash.util.cli import ConfigError
from dflash.util.runtime import allow_compiled_variants, compile_dynamic

logger = logging.getLogger(__name__)


@dataclass
class RankContext:
    """What the run settled before this rank took its role."""

    config: RunConfig
    ranks: RankInfo
    topology: Topology
    dcfg: Any  # the drafter's PretrainedConfig (with its target's shapes)
    tokenizer: Any
    dataset: TokenDataset
    target: FrozenTarget | None  # on target and colocated ranks
    data_group: Any  # the drafter ranks' process group (ZeRO, metrics, the spike decision)
    self_group: Any  # this rank alone (DeepSpeed's model-parallel slot)
    probe: ProbeSequences | None = None  # the periodic tau's sequences, on drafter rank 0

    @property
    def drafter_rank(self) -> int:
        return self.topology.drafter_ranks.index(self.ranks.rank)

    @property
    def out_dir(self) -> Path:
        return Path(self.config.train.output_dir)


@dataclass
class DrafterRun:
    """A drafter rank ready to train: the loop reads its state from here."""

    engine: Any  # deepspeed.DeepSpeedEngine
    sampler: RankAwareBucketSampler
    step: DrafterStep
    scheduler: torch.optim.lr_scheduler.LambdaLR
    lr_schedule: LRSchedule  # the scheduler's curve, which a --max-minutes estimate spreads anew
    checkpointer: Checkpointer
    guard: SpikeGuard
    tally: StepTally
    anchors: np.ndarray  # anchors per sample, as the FLOP model counts them and the anchor sampling pads to
    total_steps: int
    start_epoch: int
    drafter_rank: int
    is_main: bool
    initial_dir: Path  # the untrained drafter, exported for the before/after eval
    recipe: dict  # the recipe flags every checkpoint records, so that a resume can check them
    budget: TimeBudget | None  # --max-minutes

    @property
    def finished(self) -> bool:
        return self.engine.global_steps >= self.total_steps

    def trainer_state(self, epoch: int, batch_step: int) -> dict:
        """What a checkpoint taken after this batch step records besides the engine's state."""
        sampler = {**self.sampler.state_dict(), "epoch": epoch, "position": batch_step + 1}
        budget = {"time_budget": self.budget.state_dict()} if self.budget else {}
        return {"sampler": sampler, "recipe": self.recipe, "spike_guard": self.guard.state_dict(),
                "step_tally": self.tally.state_dict(), **budget}


def build_drafter_run(ctx: RankContext) -> DrafterRun:
    import deepspeed

    config, dcfg, topology = ctx.config, ctx.dcfg, ctx.topology
    device, drafter_rank = ctx.ranks.device, ctx.drafter_rank
    is_main = drafter_rank == 0
    drafter = initial_drafter(ctx, log=is_main)
    embed, lm_head = frozen_embedding_and_head(config, ctx.target, device)
    ds_config = deepspeed_config(config, device)
    newest = resume_point(ctx.out_dir, log=is_main) if config.train.resume else None
    if newest is not None and saved_drafter_ranks(newest) != len(topology.drafter_ranks):
        ds_config["checkpoint"]["load_universal"] = True  # ZeRO state resharded from the universal copy
    sampler, anchors = plan_batches(ctx, drafter, ds_config, newest)
    steps_per_epoch = math.ceil(sampler.steps_per_epoch() / config.train.grad_accum)
    total_steps = planned_total_steps(config, steps_per_epoch)
    initial_dir = ctx.out_dir / "drafter-init"
    if is_main:
        export_drafter(drafter, initial_dir)
    lr_schedule = LRSchedule(total_steps, config.train.warmup_ratio, config.train.lr_schedule,
                             config.train.decay_ratio, config.train.min_warmup_steps)
    engine, _, _, scheduler = deepspeed.initialize(
        model=drafter, optimizer=make_optimizer(config, drafter, ds_config, device),
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule), config=ds_config,
        mpu=DrafterParallelism(ctx.data_group, ctx.self_group, topology.drafter_ranks),
    )
    gamma = None if config.train.slot_weights == "uniform" else (
        config.train.gamma if config.train.gamma is not None else default_gamma(dcfg.block_size))
    settings = step_settings(config, dcfg, gamma, device)
    if config.model.kernels == "fast" and device.type == "cuda":
        allow_compiled_variants()
        for layer in engine.module.layers:  # fuses the norms, RoPE and SiLU; shapes vary, so dynamic
            compile_dynamic(layer)
    if is_main:
        logger.info(
            "drafter %d layers, %.1fM trainable params | features from target layers %s | B=%d A=%d | loss %s, "
            "slot weights %s | %d sequences, %d steps/epoch, %d steps, attention %s",
            dcfg.num_hidden_layers, sum(p.numel() for p in drafter.parameters()) / 1e6, dcfg.dflash_config[
                "target_layer_ids"], dcfg.block_size, config.train.max_anchors, config.train.loss,
            "uniform" if gamma is None else f"gamma={gamma}", len(ctx.dataset),
            steps_per_epoch, total_steps, settings.attention_backend,
        )
    start_epoch = 0
    guard, tally = SpikeGuard(config.train.spike_factor, group=ctx.data_group), StepTally()
    budget = TimeBudget(config.train.max_minutes, total_steps, ctx.data_group, device) \
        if config.train.max_minutes else None
    if config.train.resume:
        start_epoch, total_steps = resume(ctx, newest, engine, sampler, lr_schedule, steps_per_epoch, guard, tally,
                                          budget)
    checkpointer = Checkpointer(engine, ctx.out_dir, config.train.save_every, config.train.keep_checkpoints,
                                drafter_rank, len(topology.drafter_ranks), ctx.data_group,
                                minutes=config.train.save_every_minutes)
    return DrafterRun(
        engine=engine, sampler=sampler, step=DrafterStep(engine.module, embed, lm_head, settings, forward=engine),
        scheduler=scheduler, lr_schedule=lr_schedule, checkpointer=checkpointer, guard=guard, tally=tally,
        anchors=anchors, total_steps=total_steps, start_epoch=start_epoch, drafter_rank=drafter_rank, is_main=is_main,
        initial_dir=initial_dir, recipe=recipe_settings(config.train), budget=budget,
    )


def initial_drafter(ctx: RankContext, log: bool) -> DFlashDrafter:
    """The drafter before training: seeded, so the same whatever was loaded before; its layers
    copied from the target's where --init-from-target-layers says; its draft vocabulary set."""
    config = ctx.config
    torch.manual_seed(config.train.seed)
    drafter = DFlashDrafter(ctx.dcfg)
    if config.model.draft_vocab:
        set_draft_vocabulary(drafter, ctx.dataset, ctx.tokenizer, log=log)
    if config.model.init_from_target_layers:
        kept = init_from_target_layers(drafter, config.model.target, config.model.init_from_target_layers)
        if log:
            logger.info("drafter layers start from target layers %s (kept their own: %s)",
                        config.model.init_from_target_layers, ", ".join(kept))
    return drafter


def set_draft_vocabulary(drafter: DFlashDrafter, dataset: TokenDataset, tokenizer, log: bool) -> None:
    """--draft-vocab N: the N tokens most frequent in the training replies (and the end of
    sequence), from the prepared data, so every drafter rank (and a resumed run) picks the same."""
    counts = dataset.reply_token_counts(drafter.config.vocab_size)
    always = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids = choose_draft_vocabulary(counts, len(drafter.draft_to_target), always)
    drafter.draft_to_target.copy_(ids)
    if log:
        logger.info("draft vocabulary: the %s tokens most frequent in the replies (of %s) hold %.3f%% of their %s "
                    "tokens", f"{len(ids):,}", f"{len(counts):,}", 100 * coverage(counts, ids), f"{counts.sum():,}")


def make_optimizer(config: RunConfig, drafter, ds_config: dict, device: torch.device):
    """AdamW as a torch optimizer; or Muon, which DeepSpeed builds itself from `ds_config` (its
    ZeRO stages orthogonalize each 2-D weight's update across the partitions) with AdamW for
    the 1-D weights: then None is returned."""
    t = config.train
    if t.optimizer == "muon":
        ds_config["optimizer"] = {"type": "Muon", "params": {
            "lr": t.lr, "adam_lr": t.lr, "muon_lr": t.muon_lr, "betas": list(ADAM_BETAS), "eps": 1e-8,
            "momentum": 0.95, "weight_decay": t.weight_decay,
            "torch_adam": True}}  # torch's AdamW for the 1-D half: DeepSpeed's FusedAdam is a JIT build
        return None
    return torch.optim.AdamW(decay_groups(drafter, t.weight_decay), lr=t.lr, betas=ADAM_BETAS,
                             fused=device.type == "cuda")


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups: `weight_decay` on the weight matrices, none on the 1-D weights
    (norm gains: decaying them shrinks the layers' outputs, not their capacity). Without weight
    decay, one group, as checkpoints made without it hold."""
    params = list(model.parameters())
    if weight_decay == 0:
        return [{"params": params, "weight_decay": 0.0}]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def default_deepspeed_config(device: torch.device) -> dict:
    """What --deepspeed-config defaults to: ZeRO-1, on a GPU with buckets of 50M elements (a tenth
    of DeepSpeed's default, less memory held for the all-reduce). Built here so that an installed
    package needs no file; ds_configs/zero1.json (GPU) and cpu.json are these settings written out
    for users to start from (a test keeps them equal)."""
    zero = {"stage": 1}
    if device.type == "cuda":
        zero.update(reduce_bucket_size=50_000_000, allgather_bucket_size=50_000_000)
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"}, "zero_optimization": zero, "steps_per_print": 1_000_000_000,
            "wall_clock_breakdown": False}


def deepspeed_config(config: RunConfig, device: torch.device) -> dict:
    """The JSON file (or the default settings) with our flags filled in where it says "auto"."""
    path = config.train.deepspeed_config
    if path is None:
        ds = default_deepspeed_config(device)
    else:
        try:
            ds = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"--deepspeed-config {path}: cannot read it as JSON ({err})") from err
    autos = {"gradient_accumulation_steps": config.train.grad_accum, "gradient_clipping": config.train.grad_clip}
    for key, value in autos.items():
        if ds.get(key, "auto") == "auto":
            ds[key] = value
    # the tag check all-reduces over the WORLD group, which target ranks never join; our tags
    # (step_N) are the same on every drafter rank by construction
    ds.setdefault("checkpoint", {}).setdefault("tag_validation", "Ignore")
    bf16, wanted = ds.setdefault("bf16", {}), train_dtype(config, device) == torch.bfloat16
    if bf16.get("enabled", "auto") == "auto":
        bf16["enabled"] = wanted
    elif bool(bf16["enabled"]) != wanted:  # the engine's weights would not match the features' dtype
        raise ConfigError(f"--deepspeed-config {path}: bf16.enabled is {bf16['enabled']} but the run trains in "
                          f"{'bf16' if wanted else 'fp32'} (--precision {config.train.precision}); set it to "
                          "\"auto\" or pass the matching --precision")
    return ds


def train_dtype(config: RunConfig, device: torch.device) -> torch.dtype:
    """Weights, features and the transport in one precision: bf16 on GPU, fp32 on CPU by default."""
    precision = config.train.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return torch.bfloat16 if precision == "bf16" else torch.float32


def step_settings(config: RunConfig, dcfg, gamma: float | None, device: torch.device) -> StepSettings:
    naive, t = config.model.kernels == "naive", config.train
    return StepSettings(
        terms=LossTerms(t.loss, t.dpace_alpha, t.dpace_weight), stride_anchors=t.anchors == "stride",
        zero_features=t.zero_features,
        max_anchors=config.train.max_anchors, slot_weights=slot_weights(dcfg.block_size, gamma),
        attention_backend="sdpa" if naive else resolve_backend(config.model.attention_backend, device),
        kl_weight=config.train.kl_weight, fused_loss=not naive,
        lm_head_chunk=1 << 62 if naive else StepSettings.lm_head_chunk,  # naive: every logit at once
    )


def draft_position_limit(config: RunConfig, dcfg, drafter, ds_config: dict, drafter_ranks: int,
                         device: torch.device, log: bool) -> int | None:
    """--max-draft-positions, or on a GPU the memory model's budget for the memory left free."""
    if config.data.max_draft_positions is not None:
        return config.data.max_draft_positions or None
    if device.type != "cuda":
        return None
    shapes = MemoryShapes(
        hidden=dcfg.hidden_size, intermediate=dcfg.intermediate_size, kv_width=dcfg.num_key_value_heads * dcfg.head_dim,
        layers=dcfg.num_hidden_layers, num_features=len(dcfg.dflash_config["target_layer_ids"]),
        vocab=head_vocab_size(dcfg), anchors=config.train.max_anchors, block_size=dcfg.block_size,
    )
    try:
        budget = draft_position_budget(
            shapes, free_device_bytes(device), sum(p.numel() for p in drafter.parameters()),
            ds_config.get("zero_optimization", {}).get("stage", 0), drafter_ranks, config.data.max_tokens,
            fast=config.model.kernels == "fast")
    except MemoryBudgetError as err:
        raise ConfigError(str(err)) from None
    if log:
        logger.info("%s (set --max-draft-positions to override)", budget.report)
    return budget.max_draft_positions


def frozen_embedding_and_head(config: RunConfig, target: FrozenTarget | None, device: torch.device):
    """The target's input embedding and lm_head, shared (colocated) or loaded alone (split:
    a drafter rank needs these two matrices, not the whole target)."""
    if target is not None:
        return target.embed_tokens, target.lm_head
    return FrozenTarget.load_embedding_and_head(config.model.target, train_dtype(config, device), device)


def plan_batches(ctx: RankContext, drafter, ds_config: dict, newest: Path | None):
    """The rank-aware sampler under both budgets, and the anchors per sample it counts with."""
    config, dcfg, drafter_ranks = ctx.config, ctx.dcfg, len(ctx.topology.drafter_ranks)
    anchors = np.maximum(np.minimum(ctx.dataset.anchor_candidates(), config.train.max_anchors), 1)
    if newest is not None and config.data.max_draft_positions is None:
        # the batches of a resumed epoch must be planned as before, whatever memory is free now
        max_positions = saved_batching(newest).get("max_draft_positions")
    else:
        max_positions = draft_position_limit(config, dcfg, drafter, ds_config, drafter_ranks, ctx.ranks.device,
                                             log=ctx.drafter_rank == 0)
    sampler = RankAwareBucketSampler(
        ctx.dataset.lengths, config.data.bucket_boundaries, config.data.max_tokens,
        num_replicas=drafter_ranks, seed=config.train.seed, num_epochs=config.train.epochs,
        draft_positions=anchors * dcfg.block_size if max_positions else None, max_draft_positions=max_positions,
        echo=config.data.reuse_features, echo_span=config.train.grad_accum,
        group_by_length=config.data.group_by_length,
    )
    return sampler, anchors


def resume_point(out_dir: Path, log: bool) -> Path | None:
    """The checkpoint --resume continues from: the newest intact one, the newer ones it skips named
    (when `log`); None where none was saved. Checkpoints that are all damaged are an error."""
    path, skipped = newest_intact_checkpoint(out_dir)
    if path is None and skipped:
        raise CheckpointError(f"--resume: every checkpoint under {checkpoint_dir(out_dir)} is damaged "
                              f"({'; '.join(skipped)}); restore one from a copy, or start afresh with --overwrite "
                              "instead of --resume")
    if log:
        for problem in skipped:
            logger.warning("--resume: skipping checkpoint %s; continuing from %s", problem, path)
    return path


def resume(ctx: RankContext, path: Path | None, engine, sampler: RankAwareBucketSampler, lr_schedule: LRSchedule,
           steps_per_epoch: int, guard: SpikeGuard, tally: StepTally, budget: TimeBudget | None) -> tuple[int, int]:
    """Load the checkpoint at `path` (the resume_point), if any, with the spike guard's, the
    step tally's and the time budget's state; return the epoch to continue in and the run's total
    steps. A checkpoint of another drafter-rank count has the rest of its epoch planned anew, and
    the LR curve is stretched over it (under --max-minutes, the next estimate plans it again)."""
    config = ctx.config
    if path is None:
        logger.info("--resume: no complete checkpoint under %s, starting from scratch", config.train.output_dir)
        return 0, lr_schedule.last_step()
    recipe = saved_recipe(path)
    if recipe is None:
        logger.warning("--resume: %s records no recipe flags (an older checkpoint); they are not checked", path)
    check_resumed_recipe(recipe or {}, config.train, path)
    state = load_checkpoint(engine, path, ctx.drafter_rank, sampler.num_replicas, config.train.seed, ctx.data_group)
    saved_ranks = int(state["sampler"]["fingerprint"].get("num_replicas", sampler.num_replicas))
    sampler.load_state_dict(state["sampler"])
    if "spike_guard" in state:
        guard.load_state_dict(state["spike_guard"])
        tally.load_state_dict(state["step_tally"])
    else:
        logger.warning("--resume: %s records no spike-guard state (an older checkpoint); the guard warms up "
                       "again", path)
    if budget is not None and "time_budget" in state:
        budget.load_state_dict(state["time_budget"])
    logger.info("resumed from %s at step %d, %s", path, engine.global_steps, sampler.progress())
    epoch = int(state["sampler"]["epoch"])
    if saved_ranks == sampler.num_replicas:
        return epoch, lr_schedule.last_step()
    total_steps = planned_total_steps(config, steps_per_epoch, done=engine.global_steps, epoch=epoch,
                                      rest_of_epoch=math.ceil(sampler.steps_per_epoch() / config.train.grad_accum))
    lr_schedule.rebase(engine.global_steps, total_steps)
    return epoch, total_steps
