"""Throughput of finished runs, per GPU of the whole job, as a markdown table.

    python -m dflash.tools.throughput runs/bench/colocated-x1 runs/bench/split-1+1 ...

Reads each run's metrics.jsonl, drops the first --skip log windows (compilation, warm-up) and
averages the rest. metrics.jsonl rates are per DRAFTER rank; the table also divides by every
GPU of the job, target ranks included, which is the figure to compare placements by.
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
    return {"run": run_dir.name, "gpus": kept[-1]["world_size"], "drafter_gpus": kept[-1]["drafter_ranks"],
            "steps": kept[-1]["step"], "tokens_per_s_per_gpu": mean("tokens_per_s") * share,
            "draft_positions_per_s_per_gpu": mean("draft_positions_per_s") * share}


def table(rows: list[dict]) -> str:
    lines = ["| run | GPUs (drafter) | steps | seq tokens/s per GPU | draft positions/s per GPU |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['gpus']} ({r['drafter_gpus']}) | {r['steps']} | {r['tokens_per_s_per_gpu']:,.0f} | "
              f"{r['draft_positions_per_s_per_gpu']:,.0f} |" for r in rows]
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
