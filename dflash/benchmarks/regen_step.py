"""One batched decode step of a target on the static-cache engine (what regeneration repeats):
ms per step and row-steps/s at given batch shapes, and with --profile the GPU kernels that take
its time (torch.profiler over a few eager steps).

    python -m dflash.benchmarks.regen_step --target model.gguf --shapes 1024x1024x600,341x3072x2400 --profile

A shape is rows x cache columns x prompt tokens (random prompts, no padding); steps run as CUDA
graph replays on a GPU, as regeneration runs them.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from dflash.target.frozen import FrozenTarget
from dflash.target.gguf import resolve_target
from dflash.target.static import StaticTarget

logger = logging.getLogger(__name__)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def time_steps(target: FrozenTarget, rows: int, capacity: int, prompt: int, steps: int, profile: bool) -> dict:
    static = StaticTarget(target, rows, capacity)
    static.set_padding([0] * rows)
    vocab = target.embed_tokens.weight.shape[0]
    ids = torch.randint(0, vocab, (rows, prompt), generator=torch.Generator().manual_seed(0)).to(target.device)
    choice, _ = static.prefill(ids)
    column = prompt
    for _ in range(3):  # graph captures of the spans ahead
        choice, _ = static.step(choice, column)
        column += 1
    synchronize(target.device)
    start = time.perf_counter()
    for _ in range(steps):
        choice, _ = static.step(choice, column)
        column += 1
    synchronize(target.device)
    seconds = (time.perf_counter() - start) / steps
    result = {"rows": rows, "capacity": static.capacity, "prompt": prompt, "ms_per_step": round(seconds * 1e3, 3),
              "row_steps_per_second": round(rows / seconds)}
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        static.graphs.enabled = False  # kernels show one by one outside a graph
        activities = [ProfilerActivity.CUDA] if target.device.type == "cuda" else [ProfilerActivity.CPU]
        with profiler(activities=activities) as prof:
            for _ in range(5):
                choice, _ = static.step(choice, column)
                column += 1
            synchronize(target.device)
        sort = "cuda_time_total" if target.device.type == "cuda" else "cpu_time_total"
        result["profile"] = prof.key_averages().table(sort_by=sort, row_limit=12, max_name_column_width=70)
    return result


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    try:
        shapes = [tuple(int(n) for n in part.split("x")) for part in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 3 or s[2] + 8 > s[1] for s in shapes):
        raise SystemExit(f"--shapes {text!r}: use rows x capacity x prompt triples with prompt + 8 <= capacity, "
                         "e.g. 1024x1024x600")
    return shapes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash.benchmarks.regen_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="an HF folder or a .gguf file")
    parser.add_argument("--shapes", default="1024x1024x600,341x3072x2400", help="rows x capacity x prompt, comma-separated")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--profile", action="store_true", help="also list the kernels that take the step's time")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    shapes = parse_shapes(args.shapes)
    device = torch.device(args.device)
    folder = resolve_target(args.target, None)
    target = FrozenTarget.load(folder, [0], getattr(torch, args.dtype), device)
    results = []
    for rows, capacity, prompt in shapes:
        result = time_steps(target, rows, capacity, prompt, args.steps, args.profile)
        logger.info("rows %d x %d columns, prompt %d: %.2f ms per step, %d row-steps/s", rows, result["capacity"],
                    prompt, result["ms_per_step"], result["row_steps_per_second"])
        if "profile" in result:
            logger.info("%s", result["profile"])
        results.append(result)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
