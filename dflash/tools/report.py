"""Plots and a one-page summary of a run, from its metrics.jsonl (and eval.json when present).

    python -m dflash.report runs/demo            # writes runs/demo/report/*.png and report.md

Plots: loss; acceptance by slot over time (teacher-forced accuracy of slots 1, 2, 4, 8, ...);
tau over time (exact, teacher-forced, from the periodic eval); throughput (draft positions/s
per GPU and MFU); queue depths per target rank (split placement); grad norm with skipped
steps marked.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402

PLOTS = ("loss", "acceptance", "tau", "throughput", "queues", "grad_norm")


def read_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"error: {path}: no metrics.jsonl; pass a run's --output-dir")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise SystemExit(f"error: {path} is empty: the run logged nothing yet")
    by_step = {r["step"]: r for r in records}  # a resumed run re-logs steps: keep the last
    return [by_step[step] for step in sorted(by_step)]


def _figure(title: str, ylabel: str):
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig, ax, path: Path) -> Path:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(records: list[dict], out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in records]
    written = {}

    fig, ax = _figure("training loss", "weighted CE")
    ax.plot(steps, [r["loss"] for r in records], label="loss")
    written["loss"] = _save(fig, ax, out / "loss.png")

    fig, ax = _figure("acceptance by slot (teacher-forced accuracy)", "accuracy")
    slots = len(records[-1]["acc"])
    for slot in sorted({1, 2, 4, 8, slots} & set(range(1, slots + 1))):
        ax.plot(steps, [r["acc"][slot - 1] for r in records], label=f"slot {slot}")
    written["acceptance"] = _save(fig, ax, out / "acceptance.png")

    fig, ax = _figure("tau (exact, teacher-forced, held-out prompts)", "tokens per target forward")
    evals = sorted({r["tau_step"]: r["tau"] for r in records if "tau" in r}.items())
    if evals:
        ax.plot([s for s, _ in evals], [t for _, t in evals], marker="o", label="tau")
    written["tau"] = _save(fig, ax, out / "tau.png")

    fig, ax = _figure("throughput per GPU", "draft positions/s")
    ax.plot(steps, [r["draft_positions_per_s"] * r["drafter_ranks"] / r["world_size"] for r in records],
            label="draft positions/s per GPU")
    if any("mfu" in r for r in records):
        mfu_ax = ax.twinx()
        mfu_ax.plot(steps, [100 * r.get("mfu", 0.0) for r in records], color="tab:orange", label="MFU %")
        mfu_ax.set_ylabel("MFU %")
    written["throughput"] = _save(fig, ax, out / "throughput.png")

    fig, ax = _figure("feature requests in flight per target rank", "queue depth")
    ranks = sorted({rank for r in records for rank in r.get("queue_depths", {})}, key=int)
    for rank in ranks:
        ax.plot(steps, [r.get("queue_depths", {}).get(rank, 0) for r in records], label=f"target rank {rank}")
    written["queues"] = _save(fig, ax, out / "queues.png")

    fig, ax = _figure("gradient norm before clipping", "norm")
    ax.plot(steps, [r.get("grad_norm", float("nan")) for r in records], label="mean in the window")
    skipped = [r["step"] for prev, r in zip([None, *records], records)
               if r["skipped_micro_batches"] + r["skipped_steps"]
               > (prev["skipped_micro_batches"] + prev["skipped_steps"] if prev else 0)]
    for i, step in enumerate(skipped):
        ax.axvline(step, color="tab:red", alpha=0.5, label="skipped micro-batch or step" if i == 0 else None)
    written["grad_norm"] = _save(fig, ax, out / "grad_norm.png")
    return written


def summary_markdown(run_dir: Path, records: list[dict], plots: dict[str, Path]) -> str:
    last = records[-1]
    lines = [f"# {run_dir.name}", "",
             f"{last['step']} optimizer steps, epoch {last['epoch'] + 1}/{last['epochs']}, "
             f"{last['elapsed_s'] / 3600:.2f} h; {last['drafter_ranks']} drafter rank(s) of {last['world_size']}.", "",
             "| | first log | last log |", "|---|---|---|",
             f"| loss | {records[0]['loss']:.3f} | {last['loss']:.3f} |",
             f"| acc slot 1 | {records[0]['acc'][0]:.3f} | {last['acc'][0]:.3f} |",
             f"| draft positions/s per GPU | {records[0]['draft_positions_per_s'] * records[0]['drafter_ranks'] / records[0]['world_size']:,.0f} "
             f"| {last['draft_positions_per_s'] * last['drafter_ranks'] / last['world_size']:,.0f} |"]
    if "tau" in last:
        lines.append(f"| tau (teacher-forced) | {next(r['tau'] for r in records if 'tau' in r):.2f} | {last['tau']:.2f} |")
    eval_file = run_dir / "eval.json"
    if eval_file.is_file():
        trained = json.loads(eval_file.read_text()).get("trained", {})
        if trained:
            lines += ["", f"Final evaluation: tau {trained['tau']:.2f} by speculative decoding "
                      f"(teacher-forced chain {trained.get('teacher_forced_tau', 0):.2f}), speedup "
                      f"{trained['speedup']:.2f}x, identical to greedy on {trained['prompts'] - trained['diverged']}"
                      f"/{trained['prompts']} prompts."]
    lines += ["", *[f"![{name}]({path.name})" for name, path in plots.items()], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m dflash.report RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    records = read_records(run_dir)
    out = run_dir / "report"
    plots = plot_all(records, out)
    (out / "report.md").write_text(summary_markdown(run_dir, records, plots))
    print(f"wrote {len(plots)} plots and {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
