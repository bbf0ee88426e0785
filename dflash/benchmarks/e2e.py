"""End-to-end training benchmark: the real training loop (`train_drafter.py`: data, sampler,
target forward, DeepSpeed engine, spike guard, metrics) on a Qwen3-8B-shaped random target,
colocated on one GPU, with the fast kernels and then the naive reference path.

    python -m dflash.benchmarks.e2e                         # assets under runs/bench, 40 steps each
    python -m dflash.benchmarks.e2e --steps 60 --extra "--max-length 2048"
    python -m dflash.benchmarks.e2e --kernels fast --emulate-gb 80   # as on an 80 GB GPU

Per run, over the log windows after the first (compilation): sequence tokens/s, draft
positions/s, TFLOP/s and MFU per GPU (dflash/drafter/flops.py against the measured bf16 matmul rate),
peak memory, mean grad norm, and where the time went (data, target forward, anchors, drafter
forward, spike check, backward, optimizer, bookkeeping: CUDA-event phase split). Then the fast
path's speed-up over the naive one (dense SDPA mask, full logits, eager layers). The fast run
also profiles 5 steps after step 20 (<run>/profile/summary.json: GPU time by kernel family,
GPU busy fraction); the log window holding them is left out of the rates.

--emulate-gb G: a helper process holds all but G GiB of the GPU during the runs, so the memory
model and the recipe defaults face what a G GB card leaves free.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from dflash.training.run_report import PROFILE_AFTER_STEPS
from dflash.util.cli import cli_parser


@dataclass
class E2EArgs:
    out: str = "runs/bench"
    steps: int = 40
    log_every: int = 10
    kernels: str = "fast,naive"
    extra: str = ""  # more train_drafter.py flags, e.g. "--max-tokens 4096"
    profile_steps: int = 5
    emulate_gb: float = 0.0
    output: str | None = None


def summarize(run_dir: Path, log_every: int, skip: int = 1, profiled: tuple[int, int] = (0, 0)) -> dict:
    """Means over the log windows after the first `skip`, leaving out those that overlap the
    profiled steps (`profiled` = (first, last) optimizer step, inclusive)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    clean = [r for r in records if r["step"] < profiled[0] or r["step"] - log_every >= profiled[1]]
    kept = clean[skip:] or records
    mean = lambda key: sum(r.get(key, 0.0) for r in kept) / len(kept)  # noqa: E731
    split: dict[str, float] = defaultdict(float)
    for record in kept:
        for phase, seconds in record.get("time_split", {}).items():
            split[phase] += seconds
    total = sum(split.values()) or 1.0
    return {
        "steps": kept[-1]["step"], "windows": len(kept),
        "tokens_per_s": mean("tokens_per_s"), "draft_positions_per_s": mean("draft_positions_per_s"),
        "tflops_per_gpu": mean("tflops_per_gpu"), "mfu": mean("mfu"),
        "peak_memory_gb": max(r.get("peak_memory_gb", 0.0) for r in records),
        "grad_norm": mean("grad_norm"), "loss": kept[-1]["loss"],
        "time_split": {phase: round(seconds / total, 4) for phase, seconds in sorted(split.items(), key=lambda x: -x[1])},
    }


def main(argv: list[str] | None = None) -> dict:
    (args,) = cli_parser(E2EArgs).parse_args_into_dataclasses(argv)
    out = Path(args.out)
    if not (out / "assets" / "target" / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "dflash.benchmarks.assets", "--out", str(out / "assets")], check=True)
    results = {}
    holder = hold_memory(args.emulate_gb) if args.emulate_gb else None
    try:
        for kernels in args.kernels.split(","):
            profile = args.profile_steps if kernels == "fast" else 0
            name = f"{kernels}-{args.emulate_gb:g}gb" if args.emulate_gb else kernels
            run_dir = out / f"e2e-{name}"
            command = [sys.executable, "-m", "dflash.training", "--target", str(out / "assets" / "target"),
                       "--train-data", str(out / "assets" / "train.jsonl"), "--output-dir", str(run_dir),
                       "--overwrite", "--max-steps", str(args.steps), "--log-every", str(args.log_every),
                       "--eval-prompts", "0", "--report-to", "none", "--kernels", kernels,
                       "--profile-steps", str(profile), *shlex.split(args.extra)]
            print("+", shlex.join(command), flush=True)
            subprocess.run(command, check=True)
            profiled = (PROFILE_AFTER_STEPS + 1, PROFILE_AFTER_STEPS + profile) if profile else (0, 0)
            results[name] = summarize(run_dir, args.log_every, profiled=profiled)
            if profile and (run_dir / "profile" / "summary.json").is_file():
                results[name]["profile"] = json.loads((run_dir / "profile" / "summary.json").read_text())
            print(json.dumps({name: results[name]}, indent=2), flush=True)
    finally:
        if holder is not None:
            holder.kill()
    if "fast" in results and "naive" in results:
        results["fast_over_naive"] = results["fast"]["draft_positions_per_s"] / results["naive"]["draft_positions_per_s"]
        print(f"fast path: {results['fast_over_naive']:.2f}x the naive path's draft positions/s", flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))
    return results


def hold_memory(keep_gb: float) -> subprocess.Popen:
    """A process holding all of the GPU's memory but `keep_gb` GiB (so training sees a smaller card)."""
    code = ("import sys, time, torch; free, total = torch.cuda.mem_get_info(); "
            "hold = torch.empty(int(total - float(sys.argv[1]) * 2**30), dtype=torch.uint8, device='cuda'); "
            "print('holding', round(hold.numel() / 2**30, 1), 'GiB', flush=True); time.sleep(1e6)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(keep_gb)], stdout=subprocess.PIPE, text=True)
    print(holder.stdout.readline().strip(), flush=True)
    return holder


if __name__ == "__main__":
    main()
