"""Training metrics: accumulate over a logging window, write JSONL (+ W&B), print one line."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dflash.drafter.objective import LossOutput, expected_acceptance_length
from dflash.util.files import write_text_durably

logger = logging.getLogger(__name__)


SCALARS = 5  # loss, ce, kl, streak sum, distinct predictions
# A drafter that still drafts this few distinct tokens at this many scored slots of a micro-batch
# after this many steps, its warmup over, has collapsed onto the most frequent tokens: its outputs
# no longer depend on its inputs, so its gradients vanish and it learns little for a long while.
# An untrained drafter drafts a few tokens everywhere too (the demo's, --max-steps 80: 1.6 at step 20, 6.6 at 50),
# hence the first steps and a long warmup's low learning rates are left alone.
COLLAPSED_DISTINCT = 2
COLLAPSE_MIN_SCORED = 256
COLLAPSE_FROM_STEP = 50


def collapsed(record: dict, warming_up: bool) -> bool:
    """Whether a logged window (`summary()` with its step) shows a collapsed drafter."""
    return (not warming_up and record["step"] >= COLLAPSE_FROM_STEP
            and record["scored_slots"] >= COLLAPSE_MIN_SCORED and record["distinct_predictions"] <= COLLAPSED_DISTINCT)


class WindowMetrics:
    """Sums over the steps since the last log; `summary()` turns them into rates."""

    def __init__(self, block_size: int, peak_tflops: float | None = None):
        self.block_size = block_size
        self.peak_tflops = peak_tflops  # MFU is reported against it when known
        self.reset()

    def reset(self) -> None:
        # [loss, ce, kl, streak sum, distinct predictions, slot_correct (B), slot_count (B)], summed
        # where the loss lives: no host sync per step, one copy per log.
        self.device_sums: torch.Tensor | None = None
        self.micro_batches = 0
        self.blocks = 0
        self.tokens = 0
        self.draft_positions = 0
        self.flops = 0.0
        self.grad_norms: list = []  # tensors or floats, as the engine returns them
        self.started = time.perf_counter()

    def add(self, out: LossOutput, tokens: int, flops: float = 0.0) -> None:
        """One micro-batch: its loss outputs, sequence tokens and FLOPs (target + drafter)."""
        scalars = torch.stack([out.mean_loss.float(), out.ce.float(), out.kl.float(),
                               out.block_streaks.sum().float(), out.distinct_predictions.float()])
        sums = torch.cat([scalars, out.slot_correct.float(), out.slot_count.float()]).double()
        self.device_sums = sums if self.device_sums is None else self.device_sums + sums
        self.micro_batches += 1
        self.blocks += int(out.block_streaks.numel())
        self.tokens += tokens
        self.draft_positions += int(out.block_streaks.numel()) * self.block_size
        self.flops += flops

    def add_grad_norm(self, norm) -> None:
        """The gradient norm of an optimizer step, before clipping."""
        if norm is not None:
            self.grad_norms.append(norm)

    def summary(self, group=None, gpus: int | None = None) -> dict:
        """Rates over the window, summed over the ranks of `group` (the drafter ranks) when given;
        throughputs are per rank of that group, TFLOP/s and MFU per GPU of the job (`gpus`,
        target ranks included: every drafter micro-batch's target forward ran somewhere)."""
        sums = self.device_sums.cpu() if self.device_sums is not None else torch.zeros(SCALARS + 2 * self.block_size,
                                                                                          dtype=torch.float64)
        counts = torch.tensor([self.micro_batches, self.blocks, self.tokens, self.draft_positions, self.flops],
                              dtype=torch.float64)
        packed = torch.cat([sums, counts])
        ranks = 1
        if group is not None and dist.is_initialized():
            on_gpu = dist.get_backend(group) == "nccl"  # NCCL reduces CUDA tensors only
            packed = packed.cuda() if on_gpu else packed
            dist.all_reduce(packed, group=group)
            packed, ranks = packed.cpu(), dist.get_world_size(group)
        bs = self.block_size
        loss, ce, kl, streak, distinct = packed[:SCALARS].tolist()
        correct, count = packed[SCALARS:SCALARS + bs], packed[SCALARS + bs:SCALARS + 2 * bs]
        micro, blocks, tokens, positions, flops = packed[SCALARS + 2 * bs:].tolist()
        n = max(micro, 1)
        seconds = max(time.perf_counter() - self.started, 1e-9)
        acc = (correct / count.clamp(min=1)).float()
        norms = [float(g) for g in self.grad_norms]
        tflops = flops / seconds / (gpus or ranks) / 1e12
        extra = {"tflops_per_gpu": tflops}
        if self.peak_tflops:
            extra["mfu"] = tflops / self.peak_tflops
        if norms:
            extra.update(grad_norm=sum(norms) / len(norms), grad_norm_max=max(norms))
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            extra["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
            # Times the caching allocator freed its cache to retry an allocation (so far): each
            # is a device-wide synchronisation, which in split placement also waits for the NCCL
            # receives posted ahead, i.e. for the target's forward of a later step.
            extra["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        return {
            "loss": loss / n,
            "ce": ce / n,
            "kl": kl / n,
            "acc": [round(float(a), 4) for a in acc[1:]],
            "eal": expected_acceptance_length(acc),
            "streak": streak / max(blocks, 1),
            # per micro-batch: how many distinct tokens the drafter drafted at how many scored slots
            "distinct_predictions": distinct / n,
            "scored_slots": float(count.sum()) / n,
            "tokens_per_s": tokens / seconds / ranks,
            "draft_positions_per_s": positions / seconds / ranks,
            **extra,
        }


class MetricsLogger:
    """metrics.jsonl always; W&B (offline by default, no account needed) when asked. The run goes
    on from `start_step` (a resumed run: its checkpoint's step)."""

    def __init__(self, output_dir: Path, report_to: str, wandb_mode: str, run_config: dict, enabled: bool,
                 start_step: int):
        self.enabled = enabled
        self.path = output_dir / "metrics.jsonl"
        self.wandb_run = None
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        self._drop_lines_after(start_step)
        if report_to == "wandb" and wandb_mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            self.wandb_run = wandb.init(
                project="dflash-train", dir=str(output_dir), mode=wandb_mode, config=run_config, reinit=True
            )

    def _drop_lines_after(self, step: int) -> None:
        """The steps after `step` are logged again by this run: an earlier run's lines for them (and
        a line torn by a kill) go, in one atomic rewrite, so that each step appears once."""
        if not self.path.is_file():
            return
        lines = self.path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if _logged_step(line) <= step]
        if len(kept) != len(lines):
            write_text_durably(self.path, "".join(kept))

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            flat = {k: v for k, v in record.items() if isinstance(v, (int, float))}
            flat.update({f"acc_{j + 1}": a for j, a in enumerate(record.get("acc", []))})
            self.wandb_run.log(flat, step=record.get("step"))

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()


class TargetLog:
    """A target rank's own progress in split placement: <output-dir>/target_metrics/rank<R>.jsonl
    after every request, and a log line at every --log-every'th step, with the time split since
    serving started (forward: the target's compute, GPU-timed on CUDA; serving: the host's time
    handling requests, which on a CPU includes the forward; idle: nothing to serve) and the
    requests queued behind the one just served. A resumed run's steps replace the earlier run's lines."""

    def __init__(self, output_dir: Path, rank: int, log_every: int):
        self.rank, self.log_every = rank, log_every
        self.path = output_dir / "target_metrics" / f"rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._started = False
        self._last_logged = -1
        self.last_step: int | None = None  # of the request served last
        # only rank 0 speaks at INFO (setup_logging), and a target rank never is rank 0: its progress
        # line goes through a logger of its own that does
        self._logger = logging.getLogger("dflash.target_progress")
        self._logger.setLevel(logging.INFO)

    def __call__(self, record: dict) -> None:
        step = self.last_step = record["step"]
        if not self._started and self.path.is_file():  # this run's first request: it redoes later steps
            lines = self.path.read_text().splitlines(keepends=True)
            write_text_durably(self.path, "".join(line for line in lines if _logged_step(line) < step))
        self._started = True
        with self.path.open("a") as f:
            f.write(json.dumps({"rank": self.rank, **record}) + "\n")
        if step % self.log_every == 0 and step > self._last_logged:  # once per step, whichever drafter asked
            self._last_logged = step
            self._logger.info("target rank %d at step %d: %d requests | forward %.0f%% | serving %.0f%% | idle %.0f%% | "
                        "queued %d | %.1f MB sent", self.rank, step, record["requests"],
                        100 * record["forward_fraction"], 100 * record["serving_fraction"],
                        100 * record["idle_fraction"], record["queued"], record["mb_sent"])


def _logged_step(line: str) -> float:
    """The step of a metrics.jsonl line; infinity for a torn line."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def progress_line(record: dict, total_steps: int) -> str:
    acc = record["acc"]
    per_gpu = record["draft_positions_per_s"] * record["drafter_ranks"] / record["world_size"]
    # with one micro-batch a step, the engine also counts each step the spike guard skipped
    skipped = " and ".join(part for part in [
        f"{record['skipped_steps']} steps" if record["skipped_steps"] else "",
        f"{record['skipped_micro_batches']} micro-batches by the spike guard" if record["skipped_micro_batches"] else "",
    ] if part)
    return " | ".join(part for part in [
        f"step {record['step']}/{total_steps}",
        f"epoch {record['epoch'] + 1}/{record['epochs']}, {100 * record['epoch_fraction']:.0f}% of this epoch",
        f"loss {record['loss']:.3f}",
        f"acc1 {acc[0]:.3f} acc{len(acc)} {acc[-1]:.3f}",
        f"tau {record['tau']:.2f} (step {record['tau_step']})" if "tau" in record else "",
        f"lr {record['lr']:.2e}",
        f"{per_gpu:,.0f} draft pos/s/GPU, {record['tokens_per_s']:.0f} tok/s",
        f"MFU {100 * record['mfu']:.1f}%" if "mfu" in record else "",
        f"{record['peak_memory_gb']:.1f} GB" if "peak_memory_gb" in record else "",
        f"grad norm {record['grad_norm']:.3g}" if "grad_norm" in record else "",
        f"skipped {skipped}" if skipped else "",
        f"queues {record['queue_depths']}" if record.get("queue_depths") else "",
        f"ETA {format_duration(record['eta_s'])}",
    ] if part)


def format_duration(seconds: float) -> str:
    minutes, _ = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    return f"{days}d {hours}h" if days else f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {int(seconds) % 60:02d}s"
