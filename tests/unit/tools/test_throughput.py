"""The placement table: per GPU of the job and per drafter GPU, the first log window dropped, the
drafter's wait for data from its time split, and the target ranks' forward share from their own
metrics."""

from __future__ import annotations

import json

import pytest

from dflash.tools.throughput import run_throughput, table


def write_run(folder, records, targets=None):
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for rank, lines in (targets or {}).items():
        (folder / "target_metrics").mkdir(exist_ok=True)
        (folder / "target_metrics" / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return folder


def window(rate, data_s, other_s):
    return {"step": 10, "world_size": 3, "drafter_ranks": 1, "tokens_per_s": rate / 5, "draft_positions_per_s": rate,
            "time_split": {"data": data_s, "drafter_forward": other_s}}


def test_split_row_has_the_drafter_gpu_rate_its_wait_and_the_targets_forward_share(tmp_path):
    run = write_run(tmp_path / "split-1+2", [window(1e6, 50.0, 50.0), window(30_000, 1.0, 49.0),
                                             window(34_000, 0.0, 50.0)],
                    targets={1: [{"forward_fraction": 0.1}, {"forward_fraction": 0.41}],
                             2: [{"forward_fraction": 0.55}]})
    row = run_throughput(run)  # the first window (compilation) is dropped
    assert row["draft_positions_per_s_per_drafter_gpu"] == pytest.approx(32_000)
    assert row["draft_positions_per_s_per_gpu"] == pytest.approx(32_000 / 3)
    assert row["data_wait_share"] == pytest.approx(0.01)
    assert row["target_forward_share"] == [0.41, 0.55]
    assert table([row]).splitlines()[-1] == "| split-1+2 | 3 (1) | 10 | 2,133 | 10,667 | 32,000 | 1.0% | 41-55% |"


def test_a_colocated_run_has_no_target_column(tmp_path):
    run = write_run(tmp_path / "colocated-x1", [window(10, 1.0, 1.0), window(20, 1.0, 3.0)])
    assert table([run_throughput(run)]).splitlines()[-1].endswith("| 25.0% | - |")
