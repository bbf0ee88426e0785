"""One batched decode step of a target on the static-cache engine (what regeneration repeats):
ms per step and row-steps/s at given batch shapes, and with --profile the GPU kernels that take
its time (torch.profiler over a few eager steps).

    python -m dflash.benchmarks.regen_step --target model.gguf --shapes 1024x1024x600,341x3072x2400 --profile

A shape is rows x cache columns x prompt tokens (random prompts, no padding); steps run as CUDA
graph replays on a GPU, as regeneration runs them.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash.target.frozen import FrozenTarget
from dflash.target.gguf import resolve_target
from dflash.target.static import StaticTarget
from dflash.util.cli import cli_parser
from dflash.util.runtime import pick_device, setup_logging, synchronize

logger = logging.getLogger(__name__)


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


@dataclass
class RegenStepArgs:
    target: str = field(metadata={"help": "an HF folder or a .gguf file"})
    shapes: str = field(default="1024x1024x600,341x3072x2400", metadata={"help": "rows x capacity x prompt, comma-separated"})
    steps: int = 50
    profile: bool = field(default=False, metadata={"help": "also list the kernels that take the step's time"})
    dtype: str = "bfloat16"
    device: str = "auto"
    output: str | None = field(default=None, metadata={"help": "also write the results as JSON here"})


def main(argv: list[str] | None = None) -> int:
    (args,) = cli_parser(RegenStepArgs).parse_args_into_dataclasses(argv)
    setup_logging(0)
    shapes = parse_shapes(args.shapes)
    target = FrozenTarget.load(resolve_target(args.target), [0], getattr(torch, args.dtype), pick_device(args.device, 0))
    results = []
    for rows, capacity, prompt in shapes:
        result = time_steps(target, rows, capacity, prompt, args.steps, args.profile)
        logger.info("rows %d x %d columns, prompt %d: %.2f ms per step, %d row-steps/s", rows, result["capacity"],
                    prompt, result["ms_per_step"], result["row_steps_per_second"])
        if "profile" in result:
            logger.info("%s", result["profile"])
        results.append(result)
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
