"""What a drafter rank tells the user, each part deciding when it is due: the run's config
(<output-dir>/run_config.json), the metrics window, the periodic exact tau, the progress line with
metrics.jsonl and W&B, the profile, the ETA."""

from __future__ import annotations

import dataclasses
import json
import logging
import time

import torch.distributed as dist

from dflash.config import RUN_CONFIG_FILE, RunConfig
from dflash.data.dataset import TokenDataset
from dflash.drafter.flops import cost_shapes, measured_peak_tflops, micro_batch_flops
from dflash.drafter.objective import LossOutput
from dflash.eval.periodic import ProbeSequences, TauProbe, memorising, probe_sequences
from dflash.placement.distributed import RankInfo
from dflash.placement.topology import Topology
from dflash.placement.transport import PairGroups
from dflash.target.frozen import FrozenTarget
from dflash.training.drafter_setup import DrafterRun, RankContext
from dflash.training.metrics import MetricsLogger, WindowMetrics, collapsed, progress_line
from dflash.training.profiling import StepProfiler
from dflash.util.files import write_text_durably
from dflash.util.phases import PhaseClock

logger = logging.getLogger(__name__)

PROFILE_AFTER_STEPS = 20  # compilation and allocator warm-up are over by then
COLLAPSE_WARN_EVERY = 100  # steps between two warnings of the same collapse


class RunReport:
    def __init__(self, ctx: RankContext, run: DrafterRun, source):
        config, device = ctx.config, ctx.ranks.device
        self.ctx, self.run, self.source = ctx, run, source
        self.clock = PhaseClock(device)
        peak = measured_peak_tflops(device.index or 0) if device.type == "cuda" else None
        self.window = WindowMetrics(ctx.dcfg.block_size, peak)
        self.shapes = cost_shapes(ctx.dcfg, config.train.max_anchors, whole_target=config.train.kl_weight > 0)
        self.probe = TauProbe(ctx.probe, run.step.embed_tokens, run.step.lm_head) if ctx.probe is not None else None
        settings = run_config(ctx)
        if run.is_main:
            write_text_durably(ctx.out_dir / RUN_CONFIG_FILE, json.dumps(settings, indent=2) + "\n")
        self.metrics = MetricsLogger(ctx.out_dir, config.train.report_to, config.train.wandb_mode,
                                     settings, enabled=run.is_main, start_step=run.engine.global_steps)
        self.profiler = StepProfiler(ctx.out_dir, PROFILE_AFTER_STEPS, config.train.profile_steps, device,
                                     enabled=run.is_main, host=config.train.profile_host)
        self.tau: dict = {}
        self.started = time.perf_counter()
        self.first_step = run.engine.global_steps
        self.collapse_warned_at: int | None = None

    def micro_batch(self, out: LossOutput, indices: list[int], ran_target: bool = True) -> None:
        """`ran_target`: the target computed this micro-batch's features for it (its FLOPs count)."""
        lengths = self.ctx.dataset.lengths[indices]
        self.window.add(out, tokens=int(lengths.sum()), flops=micro_batch_flops(
            self.shapes, lengths, self.run.anchors[indices], with_target=ran_target))

    def optimizer_step(self, epoch: int, batch_step: int, applied: bool) -> None:
        """`applied`: the step updated the weights; a skipped step's gradient norm (inf, or that of a
        gradient the spike guard threw away) stays out of the window's."""
        train, step = self.ctx.config.train, self.run.engine.global_steps
        if applied:
            self.window.add_grad_norm(self.run.engine.get_global_grad_norm())
        self.profiler.step_done(step)
        if self.probe is not None and (step % train.eval_every == 0 or self.run.finished):
            self.measure_tau()
        if step % train.log_every == 0 or self.run.finished:
            self.log(epoch, batch_step)

    def measure_tau(self) -> None:
        self.clock.mark("bookkeeping")
        step = self.run.engine.global_steps
        self.tau = {"tau_step": step, **self.probe.measure(self.run.engine.module)}
        self.window.started += self.tau["eval_seconds"]  # the window's rates count training time only
        self.clock.mark("eval")
        logger.info("step %d: tau %.2f (exact, teacher-forced on %d held-out prompts; %.2f on as many training "
                    "samples; %.1f s)", step, self.tau["tau"], len(self.probe.sequences), self.tau["train_tau"],
                    self.tau["eval_seconds"])
        if memorising(self.tau["train_tau"], self.tau["tau"]):
            logger.warning("step %d: tau on training samples %.2f is far above the held-out %.2f: the drafter is "
                           "memorising its data; train on more distinct samples (fewer epochs)",
                           step, self.tau["train_tau"], self.tau["tau"])

    def log(self, epoch: int, batch_step: int) -> None:
        run, ctx = self.run, self.ctx
        engine, elapsed = run.engine, time.perf_counter() - self.started
        per_step = elapsed / max(engine.global_steps - self.first_step, 1)
        last = self.window.summary(ctx.data_group, gpus=ctx.ranks.world_size)
        last.update(self.tau)
        last["time_split"] = {phase: round(seconds, 4) for phase, seconds in self.clock.split().items()}
        last.update(step=engine.global_steps, epoch=epoch, epochs=ctx.config.train.epochs,
                    epoch_fraction=(batch_step + 1) / run.sampler.steps_per_epoch(),
                    lr=run.scheduler.get_last_lr()[0], elapsed_s=elapsed,
                    eta_s=(run.total_steps - engine.global_steps) * per_step,
                    queue_depths=self.source.queue_depths(), world_size=ctx.ranks.world_size,
                    drafter_ranks=len(ctx.topology.drafter_ranks),
                    skipped_micro_batches=run.guard.skipped, skipped_steps=engine.skipped_steps)
        self.metrics.log(last)
        if run.is_main:
            logger.info(progress_line(last, run.total_steps))
            self.warn_if_collapsed(last)
        self.window.reset()

    def warn_if_collapsed(self, record: dict) -> None:
        step, schedule = record["step"], self.run.lr_schedule
        if not collapsed(record, warming_up=schedule.warming_up(step)) or (
                self.collapse_warned_at is not None and step - self.collapse_warned_at < COLLAPSE_WARN_EVERY):
            return
        self.collapse_warned_at = step
        t = self.ctx.config.train
        logger.warning("step %d: the drafter drafts %.0f distinct token(s) at %.0f scored slots a micro-batch: its "
                       "outputs collapsed onto the most frequent tokens, and it learns little until it leaves that "
                       "state (a learning rate that rose too fast for this target: on Qwen2.5-Coder-0.5B a 10-step "
                       "warmup to --lr 3e-3 collapsed where a 30-step one did not); restart with a lower --lr (now %g) "
                       "or a longer warmup (--min-warmup-steps, now %d; --warmup-ratio, now %g)", step,
                       record["distinct_predictions"], record["scored_slots"], t.lr, t.min_warmup_steps, t.warmup_ratio)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def close(self) -> None:
        self.metrics.close()


def held_out_probe(config: RunConfig, ranks: RankInfo, topology: Topology, target: FrozenTarget | None, tokenizer,
                   dataset: TokenDataset, thinking: str, pairs: PairGroups | None) -> ProbeSequences | None:
    """The periodic tau's sequences and the target's features of them, for drafter rank 0, which
    measures it: computed there when it holds the target (colocated); in split mode computed by the
    first target rank and sent once, at start, over the pair's gloo channel (before the transport's
    first message, which both ranks then wait for). Called on every rank; None where not needed."""
    t, data = config.train, config.data
    if t.eval_every == 0 or t.eval_prompts == 0 or data.eval_data is None:
        return None
    measurer = topology.drafter_ranks[0]
    source = measurer if topology.colocated else topology.target_ranks[0]
    if ranks.rank not in (measurer, source):
        return None
    probe = None
    if ranks.rank == source:
        probe = probe_sequences(target, tokenizer, data.eval_data, t.eval_prompts, t.eval_max_new_tokens,
                                config.model.block_size, dataset, thinking)
    if source != measurer:
        box = [probe]
        dist.broadcast_object_list(box, src=source, group=pairs[(measurer, source)].control)
        probe = box[0]
    return probe if ranks.rank == measurer else None


def run_config(ctx: RankContext) -> dict:
    """The run's flags, one flat mapping, with --thinking resolved to the mode its prompts were
    rendered in (on, off, or none: the chat template has no switch)."""
    config = ctx.config
    return {**dataclasses.asdict(config.model), **dataclasses.asdict(config.data), **dataclasses.asdict(config.train),
            "thinking": ctx.dcfg.dflash_config["thinking"]}
