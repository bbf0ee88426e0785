"""Throughput of finished runs, per GPU of the whole job, as a markdown table.

    python -m dflash.tools.throughput runs/bench/colocated-x1 runs/bench/split-1+1 ...

Reads each run's metrics.jsonl, drops the first --skip log windows (compilation, warm-up) and
averages the rest. metrics.jsonl rates are per DRAFTER rank; the table also divides by every
GPU of the job, target ranks included, which is the figure to compare placements by. It adds
the drafter's wait for data and features (the time split's `data` phase, as a share of its
step) and, in split placement, the target ranks' forward share of their wall time (their own
target_metrics/rank<R>.jsonl, last line; a range over several target ranks).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def run_throughput(run_dir: Path, skip: int = 1) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kept = records[skip:] or records
    if not kept:
        raise SystemExit(f"{run_dir / 'metrics.jsonl'}: no log lines; run longer or lower --log-every")
    share = kept[-1]["drafter_ranks"] / kept[-1]["world_size"]  # drafter GPUs over all GPUs
    mean = lambda key: sum(r[key] for r in kept) / len(kept)  # noqa: E731
    split = [r["time_split"] for r in kept if r.get("time_split")]
    waited = sum(t.get("data", 0.0) for t in split) / max(sum(sum(t.values()) for t in split), 1e-9)
    return {"run": run_dir.name, "gpus": kept[-1]["world_size"], "drafter_gpus": kept[-1]["drafter_ranks"],
            "steps": kept[-1]["step"], "tokens_per_s_per_gpu": mean("tokens_per_s") * share,
            "draft_positions_per_s_per_gpu": mean("draft_positions_per_s") * share,
            "draft_positions_per_s_per_drafter_gpu": mean("draft_positions_per_s"),
            "data_wait_share": waited if split else None, "target_forward_share": target_forward_shares(run_dir)}


def target_forward_shares(run_dir: Path) -> list[float]:
    """Each target rank's forward time over its wall time, from its last target_metrics line."""
    shares = []
    for path in sorted((run_dir / "target_metrics").glob("rank*.jsonl")):
        lines = path.read_text().splitlines()
        if lines:
            shares.append(json.loads(lines[-1])["forward_fraction"])
    return shares


def _share(values: list[float]) -> str:
    if not values:
        return "-"
    low, high = min(values), max(values)
    return f"{100 * low:.0f}%" if round(100 * low) == round(100 * high) else f"{100 * low:.0f}-{100 * high:.0f}%"


def table(rows: list[dict]) -> str:
    lines = ["| run | GPUs (drafter) | steps | seq tokens/s per GPU | draft positions/s per GPU "
             "| draft positions/s per drafter GPU | drafter waits for data | target GPU forward |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        wait = "-" if r["data_wait_share"] is None else f"{100 * r['data_wait_share']:.1f}%"
        lines.append(f"| {r['run']} | {r['gpus']} ({r['drafter_gpus']}) | {r['steps']} | "
                     f"{r['tokens_per_s_per_gpu']:,.0f} | {r['draft_positions_per_s_per_gpu']:,.0f} | "
                     f"{r['draft_positions_per_s_per_drafter_gpu']:,.0f} | {wait} | {_share(r['target_forward_share'])} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    skip = 1
    if argv[:1] == ["--skip"]:
        skip, argv = int(argv[1]), argv[2:]
    if not argv:
        raise SystemExit("usage: python -m dflash.tools.throughput [--skip N] RUN_DIR [RUN_DIR ...]")
    print(table([run_throughput(Path(d), skip) for d in argv]))


if __name__ == "__main__":
    main(sys.argv[1:])
