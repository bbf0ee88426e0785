"""The ablations behind the recipe's defaults: each group trains the demo drafter with one flag
changed from a fixed baseline (BASELINE), on the same data and steps, over several seeds, and
reports the real tau (speculative decoding on the held-out prompts, eval.json's `trained.tau`)
as mean and spread.

    python -m dflash.tools.ablations --out runs/ablations --seeds 0,1,2 --parallel 8
    python -m dflash.tools.ablations --out /tmp/abl --groups loss --seeds 0 --extra "--max-steps 20"
    python -m dflash.tools.ablations --out runs/ablations --table-only   # what has finished so far
    python -m dflash.tools.ablations --out runs/abl_real --baseline "" --groups distillation --seeds 0 \
        --extra "--target model.gguf --train-data regen.jsonl --eval-data heldout.jsonl --max-steps 400"
    python -m dflash.tools.ablations --out runs/small --baseline "" --seeds 0 \
        --groups "anchors per sequence,block size,draft layers,learning rate,draft vocabulary" \
        --extra "--target model.gguf --train-data regen.jsonl --eval-data heldout.jsonl --max-minutes 3"

The last probes a small target's recipe at equal GPU time: --max-minutes gives every variant the
same minutes, whatever its step costs. `--score teacher-forced` there scores each run by the exact
tau its training logs at its last step (dflash/eval/periodic.py: the chain real decoding walks,
on --eval-prompts held-out prompts) and skips the closing decode (`--final-eval false`), which on a
GPU costs nearly as much as a 2-minute probe.

The baseline is `--loss ce --lr-schedule cosine` unless --baseline says otherwise ("" for the
recipe's own defaults, e.g. on a real target; "--preset small" for a small target's); one --out
holds one baseline's runs. Under another baseline a variant can be the baseline itself (B=16 under
the recipe's defaults, B=8 under --preset small): it is not trained again, and the group's baseline
row takes its name.

Runs that already wrote eval.json are reused, so an interrupted sweep continues where it
stopped. The table goes to <out>/ablations.md and the numbers to <out>/ablations.json.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dflash.config import parse_config
from dflash.util.cli import cli_parser

# Every run starts from these flags (--baseline), so the table stays one baseline as defaults
# move: the recipe's loss became dpace and the demo's schedule wsd because of this table,
# measured against the CE + cosine baseline.
BASELINE = "--loss ce --lr-schedule cosine"
# group -> [(variant name, flags after BASELINE)]; the first variant of each group is the baseline.
GROUPS: dict[str, list[tuple[str, list[str]]]] = {
    "loss": [("ce", []), ("dpace", ["--loss", "dpace"]), ("ce+dpace", ["--loss", "ce+dpace"])],
    "slot weights": [("decay", []), ("uniform", ["--slot-weights", "uniform"])],
    "anchors": [("random", []), ("stride", ["--anchors", "stride"])],
    "feature layers": [("default", []), ("3", ["--num-target-features", "3"]), ("1", ["--num-target-features", "1"])],
    "draft layers": [("default", []), ("1", ["--num-draft-layers", "1"]), ("3", ["--num-draft-layers", "3"]),
                     ("5", ["--num-draft-layers", "5"]), ("8", ["--num-draft-layers", "8"])],
    "attention": [("full", []), ("window 64", ["--draft-window", "64"])],
    "optimizer": [("adamw", []), ("muon", ["--optimizer", "muon"]),
                  ("muon, lr 0.08", ["--optimizer", "muon", "--muon-lr", "0.08"]),
                  ("muon, lr 0.2", ["--optimizer", "muon", "--muon-lr", "0.2"])],
    "lr schedule": [("cosine", []), ("wsd", ["--lr-schedule", "wsd"])],
    "features": [("target's", []), ("zeroed (control)", ["--zero-features"])],
    "distillation": [("off", []), ("kl 1", ["--kl-weight", "1"])],
    "feature noise": [("off", []), ("0.1", ["--feature-noise-std", "0.1"])],
    # what a small target's drafter learns per GPU-minute: probe these at equal time (--extra "--max-minutes M");
    # each lists the recipe's and the small preset's values, so either baseline tests the other
    "anchors per sequence": [("default", []), ("512", ["--max-anchors", "512"]), ("256", ["--max-anchors", "256"]),
                             ("128", ["--max-anchors", "128"])],
    "block size": [("default", []), ("8", ["--block-size", "8"]), ("16", ["--block-size", "16"])],
    "learning rate": [("6e-4", []), ("3e-4", ["--lr", "3e-4"]), ("1.2e-3", ["--lr", "1.2e-3"])],
    "draft vocabulary": [("default", []), ("every token", ["--draft-vocab", "0"]), ("32768", ["--draft-vocab", "32768"])],
}


@dataclass
class AblationArgs:
    out: str = "runs/ablations"
    seeds: str = "0,1,2"
    groups: str = ""  # comma-separated group names (default: all)
    parallel: int = 1  # runs at once (on a GPU host, several tiny demo runs share a GPU)
    extra: str = ""  # more train_drafter.py flags for every run
    baseline: str = BASELINE  # the flags every variant changes one of ("": the recipe's defaults)
    table_only: bool = False  # tabulate the finished runs, train nothing (the seeds column says how many)
    score: str = "decoded"  # decoded (the closing real decoding's tau) | teacher-forced (the tau logged at the last step)


def variants_run(group: str, baseline: str, extra: str) -> list[tuple[str, list[str]]]:
    """The group's variants, less those whose flags give the baseline's own configuration
    (defaults and preset filled in): the first of those names the baseline's row instead."""
    def resolved(flags: list[str]) -> dict:
        return asdict(parse_config([*shlex.split(baseline), *flags, *shlex.split(extra)], for_training=False))

    (first, flags), *others = GROUPS[group]
    same = resolved(flags)
    repeats = [name for name, variant in others if resolved(variant) == same]
    return [(repeats[0] if repeats else first, flags)] + [(name, variant) for name, variant in others
                                                          if name not in repeats]


def run_dir(out: Path, flags: list[str], seed: int) -> Path:
    """One folder per distinct flag set and seed: the default variant is trained once for all groups."""
    name = "-".join(f.lstrip("-").replace("/", "_") for f in flags) or "default"
    return out / f"{name}-seed{seed}"


def train_once(folder: Path, flags: list[str], seed: int, extra: str, gpu: int | None = None,
               baseline: str = BASELINE, score: str = "decoded") -> None:
    """Train one run (on the given GPU, if any) unless it has finished."""
    if finished_tau(folder, score) is not None:
        return
    cmd = [sys.executable, "-m", "dflash.training", "--output-dir", str(folder), "--overwrite",
           "--report-to", "none", "--seed", str(seed), *shlex.split(baseline), *flags, *shlex.split(extra)]
    if score == "teacher-forced":
        cmd += ["--final-eval", "false"]
    env = dict(os.environ) if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
    folder.mkdir(parents=True, exist_ok=True)
    with (folder.parent / f"{folder.name}.log").open("w") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}); see {folder.parent / folder.name}.log")


def finished_tau(folder: Path, score: str = "decoded") -> float | None:
    """A finished run's tau, None while it has not finished: `decoded`, the closing real decoding's
    (eval.json's `trained.tau`); `teacher-forced`, the exact tau measured at the last step of a run
    whose drafter is exported (its metrics.jsonl's last record)."""
    if score == "decoded":
        report = folder / "eval.json"
        return float(json.loads(report.read_text())["trained"]["tau"]) if report.is_file() else None
    metrics = folder / "metrics.jsonl"
    if not (folder / "drafter" / "config.json").is_file() or not metrics.is_file():
        return None
    last = json.loads(metrics.read_text().splitlines()[-1])
    if last.get("tau_step") != last["step"]:
        raise RuntimeError(f"{metrics}: no exact tau at the last step ({last['step']}); the runs need --eval-data "
                           "and --eval-prompts > 0 to be scored --score teacher-forced")
    return float(last["tau"])


def table(results: dict[str, list[tuple[str, list[float]]]]) -> str:
    lines = ["| group | variant | tau (mean) | spread (min-max) | seeds |", "|---|---|---|---|---|"]
    for group, variants in results.items():
        for variant, taus in variants:
            if not taus:
                lines.append(f"| {group} | {variant} | not run | | 0 |")
                continue
            lines.append(f"| {group} | {variant} | {statistics.mean(taus):.2f} | {min(taus):.2f}-{max(taus):.2f} "
                         f"| {len(taus)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    (args,) = cli_parser(AblationArgs).parse_args_into_dataclasses(argv)
    out, seeds = Path(args.out), [int(s) for s in args.seeds.split(",")]
    names = [g.strip() for g in args.groups.split(",") if g.strip()] or list(GROUPS)
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        raise SystemExit(f"--groups: unknown {unknown}; known: {', '.join(GROUPS)}")
    if args.score not in ("decoded", "teacher-forced"):
        raise SystemExit(f"--score {args.score}: use decoded or teacher-forced")
    groups = {n: variants_run(n, args.baseline, args.extra) for n in names}
    jobs = {run_dir(out, flags, seed): (flags, seed) for n in names for _, flags in groups[n] for seed in seeds}
    if not args.table_only:
        gpus = torch.cuda.device_count()

        def run(index: int, folder: Path) -> None:  # runs take the visible GPUs in turn
            train_once(folder, *jobs[folder], args.extra, index % gpus if gpus else None, args.baseline, args.score)

        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            list(pool.map(run, range(len(jobs)), jobs))
    results = {n: [(variant, [tau for s in seeds
                              if (tau := finished_tau(run_dir(out, flags, s), args.score)) is not None])
                   for variant, flags in groups[n]] for n in names}
    (out / "ablations.json").write_text(json.dumps(results, indent=1))
    (out / "ablations.md").write_text(table(results))
    print(table(results))
    return results


if __name__ == "__main__":
    main()
