"""The logging window: rates from summed counts, the progress line users read, and metrics.jsonl
holding each step once after a resume."""

from __future__ import annotations

import json

import torch

from dflash.drafter.objective import LossOutput
from dflash.training.metrics import COLLAPSE_FROM_STEP, MetricsLogger, WindowMetrics, collapsed, progress_line


def loss_output(correct: list[float], count: list[float], streaks: list[int], distinct: float = 3.0) -> LossOutput:
    zero = torch.tensor(0.0)
    return LossOutput(loss=torch.tensor(2.0), mean_loss=torch.tensor(2.0), ce=torch.tensor(2.0), kl=zero, slot_correct=torch.tensor(correct),
                      slot_count=torch.tensor(count), block_streaks=torch.tensor(streaks),
                      distinct_predictions=torch.tensor(distinct))


def test_window_pools_counts_before_dividing():
    window = WindowMetrics(block_size=3)
    window.add(loss_output([0, 1, 0], [0, 1, 1], [1]), tokens=10)
    window.add(loss_output([0, 2, 1], [0, 3, 3], [2, 0, 1]), tokens=30)
    summary = window.summary()
    assert summary["acc"] == [0.75, 0.25]  # (1+2)/(1+3), (0+1)/(1+3): pooled, not averaged
    assert summary["streak"] == 1.0  # 4 leading-correct slots over 4 blocks
    assert abs(summary["eal"] - (0.75 + 0.75 * 0.25)) < 1e-6
    assert summary["loss"] == 2.0
    assert summary["distinct_predictions"] == 3.0 and summary["scored_slots"] == 4.0  # per micro-batch: 2 + 6 slots


def test_a_drafter_drafting_a_few_tokens_everywhere_past_the_first_steps_and_warmup_is_collapsed():
    healthy = {"step": COLLAPSE_FROM_STEP, "scored_slots": 80000.0, "distinct_predictions": 900.0}
    assert not collapsed(healthy, warming_up=False)
    stuck = {**healthy, "distinct_predictions": 1.0}
    assert collapsed(stuck, warming_up=False)
    assert not collapsed(stuck, warming_up=True), "a long warmup's first steps barely move the drafter"
    assert not collapsed({**stuck, "step": COLLAPSE_FROM_STEP - 1}, warming_up=False), "still starting"
    assert not collapsed({**stuck, "scored_slots": 20.0}, warming_up=False), "too few slots to tell"


def test_progress_line_names_epoch_and_fraction():
    record = {"step": 120, "epoch": 1, "epochs": 6, "epoch_fraction": 0.375, "loss": 1.5, "acc": [0.8, 0.4],
              "streak": 2.0, "eal": 1.1, "lr": 3e-4, "tokens_per_s": 1234.0, "draft_positions_per_s": 3000.0,
              "drafter_ranks": 6, "world_size": 8, "skipped_micro_batches": 1, "skipped_steps": 1,
              "queue_depths": {6: 2, 7: 1}, "eta_s": 7 * 3600 + 5 * 60, "mfu": 0.523, "grad_norm": 0.91,
              "tau": 3.456, "tau_step": 100}
    line = progress_line(record, 600)
    assert line.startswith("step 120/600 | epoch 2/6, 38% of this epoch | loss 1.500 | acc1 0.800 acc2 0.400")
    for part in ("tau 3.46 (step 100)", "2,250 draft pos/s/GPU", "MFU 52.3%", "grad norm 0.91",
                 "skipped 1 steps and 1 micro-batches by the spike guard",
                 "queues {6: 2, 7: 1}", "ETA 7h 05m"):
        assert part in line, (part, line)
    quiet = {k: v for k, v in record.items() if k not in ("tau", "mfu", "grad_norm")}
    line = progress_line({**quiet, "skipped_micro_batches": 0, "skipped_steps": 0, "queue_depths": {}}, 600)
    assert "tau" not in line and "skipped" not in line and "queues" not in line and "MFU" not in line


def test_a_resumed_run_replaces_the_lines_after_its_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": step}) + "\n" for step in range(1, 5)) + '{"step": 5, "lo')
    logger = MetricsLogger(tmp_path, "none", "disabled", {}, enabled=True, start_step=2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    logger.log({"step": 3})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
