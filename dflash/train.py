"""The training run: config -> topology -> data -> target -> transport -> drafter step -> metrics
-> export.

Colocated: every rank holds the frozen target and a drafter replica. Split: target ranks only
serve features; drafter ranks train one DeepSpeed engine whose data-parallel group (and ZeRO
sharding) is the drafter ranks alone.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dflash.attention import resolve_backend
from dflash.checkpoint import Checkpointer, latest_checkpoint, load_checkpoint, saved_batching, saved_drafter_ranks
from dflash.config import REPO_ROOT, ConfigError, RunConfig, earlier_run_files
from dflash.data import TokenDataset, load_tokenizer
from dflash.data_tools import prepare_train_shard, train_shard_dir
from dflash.distributed import RankInfo
from dflash.drafter_step import DrafterStep, StepSettings
from dflash.export import export_drafter
from dflash.feature_source import LocalFeatures, RemoteFeatures, compute_features
from dflash.flops import CostShapes, measured_peak_tflops, micro_batch_flops
from dflash.memory import MemoryBudgetError, MemoryShapes, draft_position_budget, free_device_bytes
from dflash.metrics import MetricsLogger, WindowMetrics, progress_line
from dflash.model import DFlashDrafter, drafter_config
from dflash.objective import default_gamma, feature_noise_std, slot_weights
from dflash.periodic_eval import TauProbe
from dflash.phases import PhaseClock
from dflash.profiling import StepProfiler
from dflash.sampler import RankAwareBucketSampler
from dflash.spike import SpikeGuard
from dflash.target import (
    FrozenTarget,
    check_target_layer_ids,
    default_target_layer_ids,
    load_target_config,
    resolve_mask_token_id,
)
from dflash.topology import (
    DrafterParallelism,
    Topology,
    drafter_groups,
    parse_target_ranks,
    plan_topology,
    ranks_per_node,
    suggest_target_ranks,
)
from dflash.transport import DrafterClient, TargetServer, TransportSpec, open_pair_groups

logger = logging.getLogger(__name__)

PROFILE_AFTER_STEPS = 20  # compilation and allocator warm-up are over by then


@dataclass
class TrainResult:
    role: str  # "drafter", "target" or "colocated"
    steps: int
    seconds: float
    drafter_dir: Path
    initial_drafter_dir: Path
    last_metrics: dict


def deepspeed_config(config: RunConfig, device: torch.device) -> dict:
    """The JSON file with our flags filled in where it says "auto"."""
    path = config.train.deepspeed_config
    if path is None:
        path = REPO_ROOT / "ds_configs" / ("zero1.json" if device.type == "cuda" else "cpu.json")
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
    bf16 = ds.setdefault("bf16", {})
    if bf16.get("enabled", "auto") == "auto":
        bf16["enabled"] = train_dtype(config, device) == torch.bfloat16
    return ds


def train_dtype(config: RunConfig, device: torch.device) -> torch.dtype:
    """Weights, features and the transport in one precision: bf16 on GPU, fp32 on CPU by default."""
    precision = config.train.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return torch.bfloat16 if precision == "bf16" else torch.float32


class LRSchedule:
    """Linear warmup over warmup_ratio of the steps, then cosine decay to 0 (a LambdaLR factor).

    A callable object, so LambdaLR's state_dict (and so every checkpoint) carries it. A resume
    onto another number of drafter ranks changes how many steps are left; `rebase` spreads them
    over the rest of the same curve, so the learning rate continues where it was.
    """

    def __init__(self, total_steps: int, warmup_ratio: float):
        self.total_steps = total_steps
        self.warmup = max(1, int(round(total_steps * warmup_ratio)))
        self.base_step, self.base_position, self.scale = 0, 0.0, 1.0  # step -> position on the curve

    def position(self, step: int) -> float:
        return self.base_position + (step - self.base_step) * self.scale

    def __call__(self, step: int) -> float:
        at = self.position(step)
        if at < self.warmup:
            return (at + 1) / self.warmup
        progress = (at - self.warmup) / max(1, self.total_steps - self.warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    def last_step(self) -> int:
        """The step at which the curve reaches its end (the run's total)."""
        return int(round(self.base_step + (self.total_steps - self.base_position) / self.scale))

    def rebase(self, step: int, total_steps: int) -> None:
        """From `step` on, the run has `total_steps` in all; the same total leaves the curve as is."""
        at = self.position(step)
        self.base_step, self.base_position = step, at
        self.scale = (self.total_steps - at) / (total_steps - step) if total_steps > step else 1.0


def planned_total_steps(config: RunConfig, steps_per_epoch: int, done: int = 0, epoch: int = 0,
                        rest_of_epoch: int | None = None) -> int:
    """Optimizer steps of the whole run: `done`, the rest of `epoch`, then whole epochs."""
    rest = steps_per_epoch if rest_of_epoch is None else rest_of_epoch
    total = done + rest + steps_per_epoch * (config.train.epochs - epoch - 1)
    return min(total, config.train.max_steps) if config.train.max_steps > 0 else total


def anchor_generator(seed: int, epoch: int, step: int, drafter_rank: int) -> torch.Generator:
    """Anchors are re-sampled every epoch and reproducible from (seed, epoch, step, rank),
    whichever rank computed the features."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + epoch) * 1_000_003 + step) * 1_009 + drafter_rank)


def build_drafter_config(config: RunConfig, tokenizer):
    target_config = load_target_config(config.model.target)
    num_layers = target_config.num_hidden_layers
    layer_ids = config.model.target_layer_ids or default_target_layer_ids(num_layers, config.model.num_target_features)
    check_target_layer_ids(layer_ids, num_layers)
    mask_id = resolve_mask_token_id(tokenizer, target_config, config.model.mask_token_id)
    return drafter_config(target_config, config.model.num_draft_layers, layer_ids, config.model.block_size, mask_id)


def clear_earlier_run(config: RunConfig, ranks: RankInfo) -> None:
    """--overwrite: rank 0 deletes what an earlier run left in --output-dir (never the prepared
    data); the others wait, so no rank writes into a half-deleted folder."""
    out_dir = Path(config.train.output_dir)
    if config.train.overwrite and ranks.rank == 0:
        for name in earlier_run_files(out_dir):
            path = out_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            logger.info("--overwrite: deleted %s", path)
    dist.barrier()


def prepare_data(config: RunConfig, tokenizer, ranks: RankInfo) -> TokenDataset:
    """Rank 0 tokenizes (or reuses the cached shard); the others wait, then open it."""
    if ranks.rank == 0:
        prepare_train_shard(config, tokenizer)
    dist.barrier()
    # Nodes that do not share rank 0's filesystem build (or reuse) their own copy.
    shard = train_shard_dir(config)
    if ranks.local_rank == 0 and not (shard / "manifest.json").is_file():
        prepare_train_shard(config, tokenizer)
    dist.barrier()
    return TokenDataset(shard)


def cost_shapes(dcfg, config: RunConfig) -> CostShapes:
    deepest = max(dcfg.dflash_config["target_layer_ids"]) + 1
    return CostShapes(
        hidden=dcfg.hidden_size, intermediate=dcfg.intermediate_size, heads=dcfg.num_attention_heads,
        kv_heads=dcfg.num_key_value_heads, head_dim=dcfg.head_dim, vocab=dcfg.vocab_size,
        target_layers_run=dcfg.num_target_layers if config.train.kl_weight > 0 else deepest,
        drafter_layers=dcfg.num_hidden_layers, num_features=len(dcfg.dflash_config["target_layer_ids"]),
        anchors=config.train.max_anchors, block_size=dcfg.block_size,
    )


def place_ranks(config: RunConfig, ranks: RankInfo, dcfg, lengths) -> Topology:
    requested = parse_target_ranks(config.train.target_ranks)
    suggested, report = suggest_target_ranks(cost_shapes(dcfg, config), lengths, ranks.world_size)
    logger.info("%s", report)
    if requested == "auto":
        requested = suggested
    topology = plan_topology(requested, ranks.world_size, ranks_per_node(ranks.world_size))
    logger.info("placement %s", topology.describe())
    return topology


def train(config: RunConfig, ranks: RankInfo) -> TrainResult:
    device = ranks.device
    dtype = train_dtype(config, device)
    tokenizer = load_tokenizer(config.model.tokenizer)
    dcfg = build_drafter_config(config, tokenizer)
    clear_earlier_run(config, ranks)
    dataset = prepare_data(config, tokenizer, ranks)
    topology = place_ranks(config, ranks, dcfg, dataset.lengths)
    data_group, self_group = drafter_groups(topology)
    pairs = None if topology.colocated else open_pair_groups(topology.drafter_ranks, topology.target_ranks)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    with_final = config.train.kl_weight > 0
    layer_ids = dcfg.dflash_config["target_layer_ids"]
    spec = TransportSpec(
        feature_dim=len(layer_ids) * dcfg.hidden_size, hidden_dim=dcfg.hidden_size, with_final_hidden=with_final,
        feature_dtype=dtype, device=device, credits=config.train.credits, timeout_s=config.train.transport_timeout_s,
    )
    target = None
    if topology.is_target(ranks.rank):
        target = FrozenTarget.load(config.model.target, layer_ids, dtype, device)
        if config.model.kernels == "fast" and device.type == "cuda":
            target.compile_pointwise()
    if not topology.is_drafter(ranks.rank):
        server = TargetServer(
            ranks.rank, topology.drafter_ranks, spec,
            lambda indices: compute_features(target, dataset, indices, pad_id, with_final), pairs,
        )
        server.serve()  # until every drafter rank says stop; rank 0's routing report has the counts
        out_dir = Path(config.train.output_dir)
        return TrainResult("target", 0, 0.0, out_dir / "drafter", out_dir / "drafter-init", {})
    if topology.colocated:
        source = LocalFeatures(target, dataset, pad_id, with_final)
    else:
        client = DrafterClient(ranks.rank, topology.target_ranks, spec, dataset.lengths, pairs, topology.nodes)
        source = RemoteFeatures(client, device)
    return train_drafter_rank(config, ranks, topology, dcfg, dataset, source, data_group, self_group, target)


def train_drafter_rank(config, ranks, topology, dcfg, dataset, source, data_group, self_group, target) -> TrainResult:
    import deepspeed

    out_dir = Path(config.train.output_dir)
    device = ranks.device
    drafter_rank = topology.drafter_ranks.index(ranks.rank)
    is_main = drafter_rank == 0
    torch.manual_seed(config.train.seed)  # same initial drafter whatever was loaded before
    drafter = DFlashDrafter(dcfg)
    embed, lm_head = frozen_embedding_and_head(config, dcfg, target, device)
    anchors = np.maximum(np.minimum(dataset.anchor_candidates(), config.train.max_anchors), 1)
    ds_config = deepspeed_config(config, device)
    newest = latest_checkpoint(out_dir) if config.train.resume else None
    if newest is not None and saved_drafter_ranks(newest) != len(topology.drafter_ranks):
        ds_config["checkpoint"]["load_universal"] = True  # ZeRO state resharded from the universal copy
    if newest is not None and config.data.max_draft_positions is None:
        # the batches of a resumed epoch must be planned as before, whatever memory is free now
        max_positions = saved_batching(newest).get("max_draft_positions")
    else:
        max_positions = draft_position_limit(config, dcfg, drafter, ds_config, len(topology.drafter_ranks), device,
                                             is_main)
    sampler = RankAwareBucketSampler(
        dataset.lengths, config.data.bucket_boundaries, config.data.max_tokens,
        num_replicas=len(topology.drafter_ranks), seed=config.train.seed, num_epochs=config.train.epochs,
        draft_positions=anchors * dcfg.block_size if max_positions else None, max_draft_positions=max_positions,
    )
    steps_per_epoch = math.ceil(sampler.steps_per_epoch() / config.train.grad_accum)
    total_steps = planned_total_steps(config, steps_per_epoch)

    initial_dir = out_dir / "drafter-init"
    if is_main:
        export_drafter(drafter, initial_dir)
    optimizer = torch.optim.AdamW(
        drafter.parameters(), lr=config.train.lr, betas=(0.9, 0.95), weight_decay=config.train.weight_decay,
        fused=device.type == "cuda",
    )
    lr_schedule = LRSchedule(total_steps, config.train.warmup_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule)
    engine, _, _, _ = deepspeed.initialize(
        model=drafter, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config,
        mpu=DrafterParallelism(data_group, self_group, topology.drafter_ranks),
    )
    gamma = config.train.gamma if config.train.gamma is not None else default_gamma(dcfg.block_size)
    settings = step_settings(config, dcfg, gamma, device)
    if config.model.kernels == "fast" and device.type == "cuda":
        for layer in engine.module.layers:  # fuses the norms, RoPE and SiLU; shapes vary, so dynamic
            layer.compile(dynamic=True)
    step = DrafterStep(engine.module, embed, lm_head, settings, forward=engine)
    if is_main:
        logger.info(
            "drafter %d layers, %.1fM trainable params | features from target layers %s | B=%d A=%d gamma=%g | "
            "%d sequences, %d steps/epoch, %d steps, attention %s",
            dcfg.num_hidden_layers, sum(p.numel() for p in drafter.parameters()) / 1e6, dcfg.dflash_config[
                "target_layer_ids"], dcfg.block_size, config.train.max_anchors, gamma, len(dataset),
            steps_per_epoch, total_steps, settings.attention_backend,
        )
    metrics = MetricsLogger(out_dir, config.train.report_to, config.train.wandb_mode, _flat_config(config),
                            enabled=is_main)
    start_epoch = 0
    if config.train.resume:
        start_epoch, other_rank_count = resume(config, engine, sampler, drafter_rank, data_group)
        if other_rank_count:  # the rest of the epoch was planned anew: stretch the LR curve over it
            total_steps = planned_total_steps(
                config, steps_per_epoch, done=engine.global_steps, epoch=start_epoch,
                rest_of_epoch=math.ceil(sampler.steps_per_epoch() / config.train.grad_accum))
            lr_schedule.rebase(engine.global_steps, total_steps)
        else:
            total_steps = lr_schedule.last_step()
    checkpointer = Checkpointer(engine, out_dir, config.train.save_every, config.train.keep_checkpoints, drafter_rank,
                                len(topology.drafter_ranks), data_group)
    guard = SpikeGuard(config.train.spike_factor, group=data_group)
    window = WindowMetrics(dcfg.block_size, measured_peak_tflops(device.index or 0) if device.type == "cuda" else None)
    shapes = cost_shapes(dcfg, config)
    clock = PhaseClock(device)
    probe = tau_probe(config, target, is_main, topology.colocated)
    tau: dict = {}
    profiler = StepProfiler(out_dir, PROFILE_AFTER_STEPS, config.train.profile_steps, device, enabled=is_main)
    started = time.perf_counter()
    first_step = engine.global_steps
    last: dict = {}
    for epoch in range(start_epoch, config.train.epochs):
        sampler.set_epoch(epoch)
        schedule = sampler.rank_batches(drafter_rank)
        for batch_step, indices, batch in source.batches(schedule, clock):
            if batch is None:  # this rank got no samples at this step: a zero step keeps lockstep
                out = step.empty_loss()
            else:
                blocks = step.sample_blocks(batch.input_ids, batch.loss_mask,
                                            anchor_generator(config.train.seed, epoch, batch_step, drafter_rank))
                clock.mark("anchors")
                noise = feature_noise_std(engine.global_steps, total_steps, config.train.feature_noise_std)
                out = step.loss(blocks, batch.target, noise_std=noise)
            clock.mark("drafter_forward")
            skip = guard.should_skip(out.loss, track=batch is not None)
            clock.mark("spike_check")
            if skip:
                logger.warning("skipped the micro-batch of step %d, epoch %d: loss %.4g vs recent median %s "
                               "(%d skipped so far)", batch_step, epoch + 1, float(out.loss.detach()),
                               f"{guard.reference:.4g}" if guard.reference is not None else "n/a", guard.skipped)
                continue
            before, skipped_before = engine.global_steps, engine.skipped_steps
            engine.backward(out.loss)
            clock.mark("backward")
            engine.step()  # ZeRO skips the update itself when the gradient norm is not finite
            clock.mark("optimizer")
            if engine.skipped_steps != skipped_before and is_main:
                logger.warning("optimizer step %d skipped: the gradient norm was not finite (%d skipped so far)",
                               engine.global_steps, engine.skipped_steps)
            if batch is not None:  # an empty micro-batch's zero loss is no sample of the loss
                window.add(out, tokens=int(dataset.lengths[indices].sum()),
                           flops=micro_batch_flops(shapes, dataset.lengths[indices], anchors[indices], with_target=True))
            boundary = engine.global_steps != before
            if boundary:
                window.add_grad_norm(engine.get_global_grad_norm())
                profiler.step_done(engine.global_steps)
            last_step = engine.global_steps >= total_steps
            if boundary and probe is not None and (engine.global_steps % config.train.eval_every == 0 or last_step):
                clock.mark("bookkeeping")
                tau = {"tau_step": engine.global_steps, **probe.measure(engine.module)}
                window.started += tau["eval_seconds"]  # the window's rates count training time only
                clock.mark("eval")
                logger.info("step %d: tau %.2f (exact, teacher-forced on %d held-out prompts, %.1f s)",
                            engine.global_steps, tau["tau"], len(probe.sequences), tau["eval_seconds"])
            if boundary and (engine.global_steps % config.train.log_every == 0 or last_step):
                last = window.summary(data_group, gpus=ranks.world_size)
                last.update(tau)
                last["time_split"] = {phase: round(seconds, 4) for phase, seconds in clock.split().items()}
                last.update(step=engine.global_steps, epoch=epoch, epochs=config.train.epochs,
                            epoch_fraction=(batch_step + 1) / sampler.steps_per_epoch(),
                            lr=scheduler.get_last_lr()[0], elapsed_s=time.perf_counter() - started,
                            eta_s=(total_steps - engine.global_steps) * (time.perf_counter() - started)
                            / max(engine.global_steps - first_step, 1),
                            queue_depths=source.queue_depths(), world_size=ranks.world_size,
                            drafter_ranks=len(topology.drafter_ranks),
                            skipped_micro_batches=guard.skipped, skipped_steps=engine.skipped_steps)
                metrics.log(last)
                if is_main:
                    logger.info(progress_line(last, total_steps))
                window.reset()
            if boundary:
                sampler_state = {**sampler.state_dict(), "epoch": epoch, "position": batch_step + 1}
                checkpointer.maybe_save(engine.global_steps, {"sampler": sampler_state})
            clock.mark("bookkeeping")
            if engine.global_steps >= total_steps:
                break
        if engine.global_steps >= total_steps:
            break
    source.close()
    checkpointer.wait()
    routing = routing_report(source.served_by, topology, data_group)
    if is_main and routing:
        logger.info("%s", routing)
    seconds = time.perf_counter() - started
    drafter_dir = out_dir / "drafter"
    if is_main:
        export_drafter(engine.module, drafter_dir)
        logger.info("trained %d steps in %.1f s; drafter exported to %s", engine.global_steps, seconds, drafter_dir)
    metrics.close()
    role = "colocated" if topology.colocated else "drafter"
    return TrainResult(role, engine.global_steps, seconds, drafter_dir, initial_dir, last)


def tau_probe(config: RunConfig, target: FrozenTarget | None, is_main: bool, colocated: bool) -> TauProbe | None:
    """The periodic exact-tau eval on drafter rank 0, where it can run: with the target on the
    rank (colocated)."""
    t = config.train
    if not is_main or t.eval_every == 0 or t.eval_prompts == 0 or config.data.eval_data is None:
        return None
    if not colocated:
        logger.info("periodic eval needs the target on the drafter rank (colocated); the final eval reports tau")
        return None
    tokenizer = load_tokenizer(config.model.tokenizer)
    return TauProbe(target, tokenizer, config.data.eval_data, t.eval_prompts, t.eval_max_new_tokens,
                    config.model.block_size)


def step_settings(config: RunConfig, dcfg, gamma: float, device: torch.device) -> StepSettings:
    naive = config.model.kernels == "naive"
    return StepSettings(
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
        vocab=dcfg.vocab_size, anchors=config.train.max_anchors, block_size=dcfg.block_size,
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


def resume(config: RunConfig, engine, sampler: RankAwareBucketSampler, drafter_rank: int,
           group) -> tuple[int, bool]:
    """Load the newest complete checkpoint, if any; return the epoch to continue in and whether
    it was written by another number of drafter ranks."""
    path = latest_checkpoint(config.train.output_dir)
    if path is None:
        logger.info("--resume: no complete checkpoint under %s, starting from scratch", config.train.output_dir)
        return 0, False
    state = load_checkpoint(engine, path, drafter_rank, sampler.num_replicas, config.train.seed, group)
    saved_ranks = int(state["sampler"]["fingerprint"].get("num_replicas", sampler.num_replicas))
    sampler.load_state_dict(state["sampler"])
    logger.info("resumed from %s at step %d, %s", path, engine.global_steps, sampler.progress())
    return int(state["sampler"]["epoch"]), saved_ranks != sampler.num_replicas


def routing_report(served_by: dict[int, int], topology: Topology, data_group) -> str:
    """Which target rank computed how many micro-batches for which drafter rank, and which of
    those pairs crossed nodes (collective over the drafter group)."""
    if topology.colocated:
        return ""
    gathered: list[dict[int, int] | None] = [None] * len(topology.drafter_ranks)
    dist.all_gather_object(gathered, served_by, group=data_group)
    lines = ["routing (drafter rank <- target rank: micro-batches):"]
    for drafter, counts in zip(topology.drafter_ranks, gathered):
        for target, count in sorted(counts.items()):
            crossed = topology.nodes[drafter] != topology.nodes[target]
            lines.append(f"  {drafter} <- {target}: {count}{'  (crossed nodes)' if crossed else ''}")
    return "\n".join(lines)


def frozen_embedding_and_head(config: RunConfig, dcfg, target: FrozenTarget | None, device: torch.device):
    """The target's input embedding and lm_head, shared (colocated) or loaded alone (split:
    a drafter rank needs these two matrices, not the whole target)."""
    if target is not None:
        return target.embed_tokens, target.lm_head
    return FrozenTarget.load_embedding_and_head(config.model.target, train_dtype(config, device), device)


def _flat_config(config: RunConfig) -> dict:
    return {**dataclasses.asdict(config.model), **dataclasses.asdict(config.data), **dataclasses.asdict(config.train)}
