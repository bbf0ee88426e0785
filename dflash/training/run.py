"""The training run: config -> data -> placement -> target -> transport -> drafter loop -> export.

A drafter rank builds its run (dflash/training/drafter_setup.py), loops over its micro-batches (here) and
reports (dflash/training/run_report.py).

Colocated: every rank holds the frozen target and a drafter replica. Split: target ranks only
serve features; drafter ranks train one DeepSpeed engine whose data-parallel group (and ZeRO
sharding) is the drafter ranks alone.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from dflash.config import RunConfig, earlier_run_files
from dflash.data.dataset import TokenDataset
from dflash.data.thinking import resolve_thinking
from dflash.data.tokenization import load_tokenizer
from dflash.data.tokenizer_match import check_tokenizer_matches_target
from dflash.drafter.export import export_drafter
from dflash.drafter.flops import cost_shapes
from dflash.drafter.model import drafter_config
from dflash.drafter.objective import Blocks, LossDenominators, LossOutput, kept_gradient_scale
from dflash.placement.distributed import RankInfo
from dflash.placement.features import (FeatureCache, FeatureSource, LocalFeatures, RecentBatches, RemoteFeatures,
                                       compute_features)
from dflash.placement.topology import (Topology, drafter_groups, parse_target_ranks, plan_topology, ranks_per_node,
                                       suggest_target_ranks)
from dflash.placement.transport import (DrafterClient, FeatureBatch, TargetServer, TransportError, TransportSpec,
                                        open_pair_groups)
from dflash.target.frozen import (FrozenTarget, check_target_layer_ids, default_target_layer_ids, load_target_config,
                                  resolve_mask_token_id)
from dflash.target.gguf import gguf_file, resolve_target, run_target_dir
from dflash.target.layer_features import use_decoder_layers
from dflash.target.packed import packed_applies, use_packed_rows
from dflash.training.checkpoint import latest_checkpoint
from dflash.training.drafter_setup import DrafterRun, RankContext, build_drafter_run, train_dtype
from dflash.training.metrics import TargetLog
from dflash.training.peer_loss import peer_losses_reported
from dflash.training.run_report import RunReport, held_out_probe
from dflash.training.schedules import feature_noise_std
from dflash.training.shard import prepare_train_shard, train_shard_dir
from dflash.training.spike import StepTally, UpdateCheck, gradient_scaled, poisoned
from dflash.util.cli import ConfigError
from dflash.util.phases import PhaseClock

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    role: str  # "drafter", "target" or "colocated"
    steps: int
    seconds: float
    drafter_dir: Path
    initial_drafter_dir: Path
    targets_finished: bool = True  # False: a target rank stalled after the drafters' last step
    target_holders: list[int] = field(default_factory=list)  # the ranks that hold the target (rank 0's result)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during the step loop, with the optimizer step the run had reached."""

    def __init__(self, step: int) -> None:
        super().__init__(step)
        self.step = step


def build_drafter_config(config: RunConfig, tokenizer, thinking: str):
    """The drafter's config; dflash_config.thinking records the mode its prompts were rendered in,
    which an evaluation must render them in too (dflash/eval/evaluate.py)."""
    target_config = load_target_config(config.model.target)
    num_layers = target_config.num_hidden_layers
    layer_ids = config.model.target_layer_ids or default_target_layer_ids(num_layers, config.model.num_target_features)
    check_target_layer_ids(layer_ids, num_layers)
    mask_id = resolve_mask_token_id(tokenizer, target_config, config.model.mask_token_id)
    if config.model.draft_vocab > target_config.vocab_size:
        raise ConfigError(f"--draft-vocab {config.model.draft_vocab}: the target has {target_config.vocab_size:,} "
                          "tokens; use fewer (0: every token)")
    dcfg = drafter_config(target_config, config.model.num_draft_layers, layer_ids, config.model.block_size, mask_id,
                          window=config.model.draft_window, draft_vocab=config.model.draft_vocab)
    dcfg.dflash_config["thinking"] = thinking
    return dcfg


def feature_cache(config: RunConfig, dataset: TokenDataset, spec: TransportSpec, ranks: RankInfo) -> FeatureCache | None:
    """A FeatureCache for this target rank when --cache-target-features is on and every sample's
    features fit in half of the memory free on its device; else the run goes on without one (it
    only saves time) and says so, rather than running out of memory epochs later."""
    if not config.data.cache_target_features:
        return None
    width = spec.feature_dim + (spec.hidden_dim if spec.with_final_hidden else 0)
    needed = int(dataset.lengths.sum()) * width * spec.feature_dtype.itemsize
    device = spec.device
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if needed > free // 2:
        logger.warning("rank %d: not caching target features (--cache-target-features): all %s samples' take "
                       "%.1f GiB, more than half of the %.1f GiB free on its %s; every epoch runs the target",
                       ranks.rank, f"{len(dataset):,}", needed / 2**30, free / 2**30, device.type)
        return None
    if ranks.rank == 0:
        logger.info("target features cached after their first epoch: up to %.2f GiB", needed / 2**30)
    return FeatureCache()


def settle_target(config: RunConfig, ranks: RankInfo) -> None:
    """A GGUF --target is de-quantized once into <output-dir>/target-hf by rank 0 (and by local
    rank 0 of a node that does not share its filesystem) while the others wait; from here on
    config.model.target names that folder, for every loader and the final evaluation."""
    if gguf_file(config.model.target) is None:
        return
    cache = run_target_dir(config.train.output_dir)
    for converts in (ranks.rank == 0, ranks.local_rank == 0):
        if converts:
            resolve_target(config.model.target, cache)
        dist.barrier()
    config.model.target = resolve_target(config.model.target, cache)  # complete by now: no conversion


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


def prepare_data(config: RunConfig, tokenizer, thinking: str, ranks: RankInfo) -> TokenDataset:
    """Rank 0 tokenizes (or reuses the cached shard); the others wait, then open it."""
    if ranks.rank == 0:
        prepare_train_shard(config, tokenizer, thinking)
    dist.barrier()
    # Nodes that do not share rank 0's filesystem build (or reuse) their own copy.
    shard = train_shard_dir(config)
    if ranks.local_rank == 0 and not (shard / "manifest.json").is_file():
        prepare_train_shard(config, tokenizer, thinking)
    dist.barrier()
    return TokenDataset(shard)


def place_ranks(config: RunConfig, ranks: RankInfo, dcfg, lengths) -> Topology:
    requested = parse_target_ranks(config.train.target_ranks)
    suggested, report = suggest_target_ranks(
        cost_shapes(dcfg, config.train.max_anchors, whole_target=config.train.kl_weight > 0), lengths, ranks.world_size)
    logger.info("%s", report)
    if requested == "auto":
        requested = suggested
    topology = plan_topology(requested, ranks.world_size, ranks_per_node(ranks.world_size))
    logger.info("placement %s", topology.describe())
    return topology


def train(config: RunConfig, ranks: RankInfo) -> TrainResult:
    """Settle the run (drafter config, data, placement), load the target where it lives, then
    serve features (target ranks) or train (drafter ranks)."""
    device = ranks.device
    dtype = train_dtype(config, device)
    tokenizer = load_tokenizer(config.model.tokenizer)
    check_tokenizer_matches_target(tokenizer, config.model.target, config.model.tokenizer,
                                   config.model.allow_tokenizer_mismatch, warn=ranks.is_main)
    settle_target(config, ranks)
    thinking = resolve_thinking(tokenizer, config.data.thinking)
    dcfg = build_drafter_config(config, tokenizer, thinking)
    clear_earlier_run(config, ranks)
    dataset = prepare_data(config, tokenizer, thinking, ranks)
    topology = place_ranks(config, ranks, dcfg, dataset.lengths)
    data_group, self_group = drafter_groups(topology)
    pairs = None if topology.colocated else open_pair_groups(topology.drafter_ranks, topology.target_ranks)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    with_final = config.train.kl_weight > 0
    groups = config.data.target_length_groups
    layer_ids = dcfg.dflash_config["target_layer_ids"]
    spec = TransportSpec(
        feature_dim=len(layer_ids) * dcfg.hidden_size, hidden_dim=dcfg.hidden_size, with_final_hidden=with_final,
        feature_dtype=dtype, device=device, credits=config.train.credits, timeout_s=config.train.transport_timeout_s,
    )
    target = load_target(config, ranks, layer_ids, dtype) if topology.is_target(ranks.rank) else None
    out_dir = Path(config.train.output_dir)
    cache = feature_cache(config, dataset, spec, ranks) if target is not None else None
    with peer_losses_reported(ranks, topology, out_dir, lambda: None):
        probe = held_out_probe(config, ranks, topology, target, tokenizer, dataset, thinking, pairs)
    if not topology.is_drafter(ranks.rank):
        served = TargetLog(out_dir, ranks.rank, config.train.log_every)
        with peer_losses_reported(ranks, topology, out_dir, lambda: served.last_step):
            server = TargetServer(
                ranks.rank, topology.drafter_ranks, spec,
                lambda indices: compute_features(target, dataset, indices, pad_id, with_final, cache=cache,
                                                 length_groups=groups), pairs,
                on_served=served,
            )
            server.serve()  # until every drafter rank says stop; rank 0's routing report has the counts
        return TrainResult("target", 0, 0.0, out_dir / "drafter", out_dir / "drafter-init")
    # an echoed micro-batch (--reuse-features) follows its first within one optimizer step's micro-batches
    recent = RecentBatches(config.train.grad_accum) if config.data.reuse_features > 1 else None
    if topology.colocated:
        source = LocalFeatures(target, dataset, pad_id, with_final, cache, recent, groups)
    else:
        with peer_losses_reported(ranks, topology, out_dir, lambda: None):
            client = DrafterClient(ranks.rank, topology.target_ranks, spec, dataset.lengths, pairs, topology.nodes)
        source = RemoteFeatures(client, device, recent)
    ctx = RankContext(config, ranks, topology, dcfg, tokenizer, dataset, target, data_group, self_group, probe)
    return train_drafter_rank(ctx, source)


def load_target(config: RunConfig, ranks: RankInfo, layer_ids: list[int], dtype: torch.dtype) -> FrozenTarget:
    """The frozen target on this rank, its features computed as --target-forward says."""
    target = FrozenTarget.load(config.model.target, layer_ids, dtype, ranks.device)
    fast_gpu = config.model.kernels == "fast" and ranks.device.type == "cuda"
    if config.model.target_forward == "decoder":
        use_decoder_layers(target, compiled=fast_gpu)
        logger.info("rank %d: the target's features come from the fast decoder's layer functions%s "
                    "(--target-forward decoder)", ranks.rank, ", compiled" if fast_gpu else "")
        return target
    forward, why = config.model.target_forward, f"--target-forward {config.model.target_forward}"
    if forward == "auto":
        kept_padded = packed_applies(target, config.data.target_length_groups)
        forward, why = ("hf", f"{why}: {kept_padded}") if kept_padded else ("packed", why)
    if forward == "packed":
        use_packed_rows(target)
        logger.info("rank %d: the target computes the real tokens only, each micro-batch's rows packed into one "
                    "sequence (%s)", ranks.rank, why)
    else:
        logger.info("rank %d: the target computes the padded micro-batch (%s)", ranks.rank, why)
    if fast_gpu:
        target.compile_pointwise()
    return target


def train_drafter_rank(ctx: RankContext, source: FeatureSource) -> TrainResult:
    """Build, loop, finish. The step, the report and the checkpointer each decide when they act."""
    run = build_drafter_run(ctx)
    report = RunReport(ctx, run, source)
    peers_lost = functools.partial(peer_losses_reported, ctx.ranks, ctx.topology, ctx.out_dir,
                                   lambda: run.engine.global_steps)
    try:  # on either, the save in flight (if any) is not the one the message names: it is cancelled
        with peers_lost(on_loss=run.checkpointer.cancel):
            train_steps(ctx, run, report, source)
    except KeyboardInterrupt as interrupt:
        run.checkpointer.cancel()
        raise Interrupted(run.engine.global_steps) from interrupt
    with peers_lost():
        return finish(ctx, run, report, source)


def train_steps(ctx: RankContext, run: DrafterRun, report: RunReport, source: FeatureSource) -> None:
    """The optimizer steps of the run, from where it starts (or resumes) to its last. The tally
    judges each step before the checkpointer may save it: skipped at once, blown up (UpdateCheck)
    by the end of the next step, or at once where a save is due."""
    clock, tally = report.clock, run.tally
    check = UpdateCheck(run.engine.module, ctx.data_group, tally)
    if run.budget is not None:
        run.budget.start(run.engine.global_steps)
    for window in accumulation_windows(epoch_batches(ctx, run, source, clock), ctx.config.train.grad_accum):
        before, stepped, whole_skip = (run.engine.global_steps, run.engine.skipped_steps), False, False
        blocks, denominators, per_micro = plan_window(ctx, run, window, clock)
        skipped: list[bool] = []
        for (epoch, batch_step, indices, batch, _), these in zip(window, blocks):
            out = micro_batch_loss(ctx, run, batch, these, denominators)
            clock.mark("drafter_forward")
            if ctx.config.train.grad_accum == 1:
                # the verdict acts on the device, so the backward is queued while the forward still runs
                flag = run.guard.vote(out.mean_loss, track=batch is not None)
                clock.mark("spike_check")
                stepped = backward_and_step(run, poisoned(out.loss, flag), clock)
                skipped.append(run.guard.settle())  # the engine's step has read its gradient norm: no wait
            else:
                skipped.append(run.guard.should_skip(out.mean_loss, track=batch is not None))
                clock.mark("spike_check")
                if skipped[-1]:  # a zero in its place keeps the engine's accumulation count on the window's boundary
                    out = run.step.empty_loss()
                loss, scale, whole_skip = kept_loss(ctx, run, out.loss, skipped, per_micro)
                stepped = backward_and_step(run, loss, clock, scale)
            if skipped[-1]:
                logger.warning("skipped the micro-batch of step %d, epoch %d: loss %.4g vs recent median %s "
                               "(%d skipped so far)", batch_step, epoch + 1, run.guard.last_loss,
                               f"{run.guard.reference:.4g}" if run.guard.reference is not None else "n/a",
                               run.guard.skipped)
            elif batch is not None:  # an empty or skipped micro-batch's loss is no sample of the loss
                report.micro_batch(out, indices, ran_target=not batch.reused)
            if stepped:
                report.optimizer_step(epoch, batch_step, applied=run.engine.skipped_steps == before[1])
            clock.mark("bookkeeping")
        count_step(run, tally, before, guard_skipped=whole_skip or all(skipped))
        saving = False
        if stepped:
            check.stepped(run.engine.global_steps)
            fit_to_budget(run)
            saving = run.checkpointer.due(run.engine.global_steps)
        if saving or not stepped:
            check.settle()  # a blown-up update is never saved, nor hidden behind the skips after it
        stop_if_failing(ctx, run)
        if saving:
            run.checkpointer.save(run.engine.global_steps, run.trainer_state(epoch, batch_step))
    check.settle()
    stop_if_failing(ctx, run)


def stop_if_failing(ctx: RankContext, run: DrafterRun) -> None:
    if run.tally.failing:
        run.checkpointer.wait()  # the save in flight, committed, is the newest checkpoint
        raise run.tally.error(ctx.config.train.lr, latest_checkpoint(ctx.out_dir))


def fit_to_budget(run: DrafterRun) -> None:
    """Under --max-minutes, at an estimate step: the steps that fit become the run's total and the
    rest of the LR curve is spread over them (dflash/training/budget.py)."""
    step = run.engine.global_steps
    total = run.budget.replan(step) if run.budget is not None else None
    if total is None or total == run.total_steps:
        return
    if run.is_main and (step == run.budget.first_estimate or total == step):
        logger.info("--max-minutes %g: %.1f s spent after step %d; the run's total is now %d steps",
                    run.budget.budget_s / 60, run.budget.spent(), step, total)
    run.lr_schedule.rebase(step, total)
    run.total_steps = total


def kept_loss(ctx: RankContext, run: DrafterRun, loss: torch.Tensor, skipped: list[bool],
              per_micro: torch.Tensor) -> tuple[torch.Tensor, float, bool]:
    """What a window's micro-batch backpropagates, the factor its engine step applies to the
    accumulated gradient, and whether the step is skipped whole. At the micro-batch that ends the
    optimizer step, the factor leaves the skipped micro-batches out of the mean (`skipped`: the
    guard's verdicts so far; `per_micro`: plan_window's denominators); where no factor does, a
    non-finite gradient makes the engine skip the update (weights, moments and LR schedule
    untouched) as it does on overflow."""
    if len(skipped) < ctx.config.train.grad_accum:
        return loss, 1.0, False
    scale = kept_gradient_scale(per_micro, skipped, run.step.settings.terms, ctx.config.train.kl_weight)
    if scale is None:
        return loss + run.step.empty_loss().loss * float("nan"), 1.0, True
    return loss, scale, False


def count_step(run: DrafterRun, tally: StepTally, before: tuple[int, int], guard_skipped: bool) -> None:
    """Whether the optimizer step of the window just run trained, or was skipped and why; `before`:
    the engine's (global_steps, skipped_steps) at its start; `guard_skipped`: the guard's skips
    left nothing to step on. A window that ends the run short of the accumulation boundary took
    no step."""
    steps, engine_skips = before
    if guard_skipped:
        tally.add(steps + 1, "with a loss not finite or a spike")
    elif run.engine.skipped_steps != engine_skips:
        tally.add(run.engine.global_steps, "with a gradient norm not finite")
        if run.is_main:
            logger.warning("optimizer step %d skipped: the gradient norm was not finite (%d skipped so far)",
                           run.engine.global_steps, run.engine.skipped_steps)
    elif run.engine.global_steps != steps:
        tally.add(run.engine.global_steps, None)


def epoch_batches(ctx: RankContext, run: DrafterRun, source: FeatureSource, clock: PhaseClock):
    """(epoch, step in the epoch, sample indices, batch, anchor draw) for this rank until the run
    is done; batch is None where this rank got no samples at that step; the anchor draw is the
    sampler's (the step whose anchor order it takes, its round along it)."""
    for epoch in range(run.start_epoch, ctx.config.train.epochs):
        if run.finished:  # a run resumed from its final checkpoint trains no further step
            return
        run.sampler.set_epoch(epoch)
        for batch_step, indices, batch in source.batches(run.sampler.rank_batches(run.drafter_rank), clock):
            yield epoch, batch_step, indices, batch, run.sampler.anchor_draw(batch_step)
            if run.finished:  # before the source fetches (in split placement, requests) another batch
                return


def accumulation_windows(items, size: int):
    """The micro-batches of one optimizer step at a time (checkpoints sit on step boundaries,
    so a resumed run starts on one)."""
    window = []
    for item in items:
        window.append(item)
        if len(window) == size:
            yield window
            window = []
    if window:
        yield window


def plan_window(ctx: RankContext, run: DrafterRun, window: list, clock: PhaseClock):
    """Each micro-batch's blocks, the loss denominators of the whole optimizer step, summed over
    its micro-batches on every drafter rank, so that the update does not depend on how the samples
    fell on ranks and accumulation steps, and those of each micro-batch [n, 2] (weight, positions;
    one all-reduce for both), which take a skipped micro-batch out of them again."""
    blocks = []
    local = torch.zeros(len(window), 2, dtype=torch.float64, device=ctx.ranks.device)
    for n, (epoch, _, indices, batch, (draw_step, draw_round)) in enumerate(window):
        if batch is None:  # this rank got no samples at this step: a zero step keeps lockstep
            blocks.append(None)
            continue
        these = run.step.sample_blocks(batch.input_ids, batch.loss_mask,
                                       anchor_generator(ctx.config.train.seed, epoch, draw_step, run.drafter_rank),
                                       draw_round, anchors_per_row=run.anchors[indices].tolist())
        counts = run.step.denominators(these)
        local[n] = torch.stack([counts.weight, counts.positions]).double()
        blocks.append(these)
    dist.all_reduce(local, group=ctx.data_group)
    clock.mark("anchors")
    total = local.sum(0)
    scale = len(ctx.topology.drafter_ranks) * ctx.config.train.grad_accum  # the engine averages over both
    return blocks, LossDenominators(total[0].float(), total[1].float(), scale), local


def micro_batch_loss(ctx: RankContext, run: DrafterRun, batch: FeatureBatch | None, blocks: Blocks | None,
                     denominators: LossDenominators) -> LossOutput:
    if batch is None:
        return run.step.empty_loss()
    noise = feature_noise_std(run.engine.global_steps, run.total_steps, ctx.config.train.feature_noise_std)
    return run.step.loss(blocks, batch.features, batch.final_hidden, noise_std=noise, denominators=denominators)


def backward_and_step(run: DrafterRun, loss: torch.Tensor, clock: PhaseClock, gradient_scale: float = 1.0) -> bool:
    """Backward and the engine step, whose update applies `gradient_scale` x the accumulated
    gradient where this micro-batch ends an optimizer step (True then)."""
    engine = run.engine
    before = engine.global_steps
    engine.backward(loss)
    clock.mark("backward")
    with gradient_scaled(engine, gradient_scale):
        engine.step()  # ZeRO skips the update itself when the gradient norm is not finite
    clock.mark("optimizer")
    return engine.global_steps != before


def anchor_generator(seed: int, epoch: int, step: int, drafter_rank: int) -> torch.Generator:
    """Anchors are re-sampled every epoch and reproducible from (seed, epoch, step, rank),
    whichever rank computed the features."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + epoch) * 1_000_003 + step) * 1_009 + drafter_rank)


def finish(ctx: RankContext, run: DrafterRun, report: RunReport, source: FeatureSource) -> TrainResult:
    """Stop the transport, wait for the last checkpoint, report routing, export the drafter, then
    wait for the targets to answer what was sent: nothing before the export needs a target rank,
    so one that stalls after the last step costs a warning, not the run. A run whose last steps
    were mostly skipped, however few, stops instead of exporting."""
    tally = run.tally
    source.stop()
    run.checkpointer.wait()
    if tally.failed_at_end:
        raise tally.error(ctx.config.train.lr, latest_checkpoint(ctx.out_dir))
    routing = routing_report(source.served_by, ctx.topology, ctx.data_group)
    if run.is_main and routing:
        logger.info("%s", routing)
    drafter_dir = ctx.out_dir / "drafter"
    steps, seconds = run.engine.global_steps, report.seconds
    if run.is_main:
        export_drafter(run.engine.module, drafter_dir)
        logger.info("trained %s in %.1f s; drafter exported to %s", steps_trained(report.first_step, steps, tally),
                    seconds, drafter_dir)
    report.close()
    role = "colocated" if ctx.topology.colocated else "drafter"
    holders = list(range(ctx.ranks.world_size)) if ctx.topology.colocated else list(ctx.topology.target_ranks)
    return TrainResult(role, steps, seconds, drafter_dir, run.initial_dir,
                       targets_finished=close_transport(ctx, source, drafter_dir), target_holders=holders)


def steps_trained(first_step: int, last_step: int, tally: StepTally) -> str:
    """The steps this run trained and skipped: "8 steps, skipped 0", or "4 steps, skipped 0 (steps
    3-6; resumed from step 2)"."""
    if first_step == 0:
        return tally.summary()
    span = f"steps {first_step + 1}-{last_step}; " if last_step > first_step else ""
    return f"{tally.summary()} ({span}resumed from step {first_step})"


def close_transport(ctx: RankContext, source: FeatureSource, drafter_dir: Path) -> bool:
    """Whether every target answered to the end, as all drafter ranks agree (a rank that saw a
    target stall must not wait for it at the final barrier, nor may the others)."""
    try:
        source.close()
        finished = 1.0
    except TransportError as err:
        logger.warning("after the last step: %s (the drafter is exported to %s; the target ranks are left "
                       "behind)", err, drafter_dir)
        finished = 0.0
    agreed = torch.tensor([finished], device=ctx.ranks.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=ctx.data_group)
    return bool(agreed.item() > 0)


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
