"""Regeneration speed on the static-cache engine: the whole engine on real prompts (new tokens/s
with the batch sized from memory, as `python -m dflash.regenerate --engine fast` runs it, model
loading left out), or at given shapes one prefill of every row (ms, prompt tokens/s) and one batched
decode step (ms per step, row-steps/s) and, with --profile, the GPU kernels that take their time
(torch.profiler over a prefill and a few eager steps).

    python -m dflash.benchmarks.regen_step --target model.gguf --prompts train_prompts.jsonl --limit 4000
    python -m dflash.benchmarks.regen_step --target model.gguf --shapes 1024x1024x600,341x3072x2400 --profile

A shape is rows x cache columns x prompt tokens (random prompts, every row at the same column);
the prefill runs eager and the steps as CUDA graph replays on a GPU, as regeneration runs them
(whose prefill chunks hold up to 32,768 tokens: 100x1536x320 is one).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash.data.chat_formats import load_chat_jsonl
from dflash.data.tokenization import load_tokenizer, many_prompt_ids
from dflash.target.frozen import FrozenTarget
from dflash.target.generate import generate_batches, stop_token_ids
from dflash.target.gguf import resolve_target
from dflash.target.graphs import GraphReplays
from dflash.target.static import StaticTarget
from dflash.util.cli import cli_parser
from dflash.util.runtime import pick_device, setup_logging, synchronize

logger = logging.getLogger(__name__)
PREFILL_REPEATS = 3


def kernel_table(target: FrozenTarget, run: Callable[[], None]) -> str:
    """The 12 costliest kernels (CPU: ops) of run() under torch.profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CUDA] if target.device.type == "cuda" else [ProfilerActivity.CPU]
    with profiler(activities=activities) as prof:
        run()
        synchronize(target.device)
    sort = "cuda_time_total" if target.device.type == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=12, max_name_column_width=70)


@torch.no_grad()
def time_steps(target: FrozenTarget, rows: int, capacity: int, prompt: int, steps: int, profile: bool,
               compiled: bool = False, compiled_prefill: bool = False) -> dict:
    """A prefill of `prompt` tokens into every row (the regeneration's prefill chunk: rows x prompt
    tokens, eager, or compiled for every shape), then `steps` graphed decode steps of all rows."""
    static = StaticTarget(target, rows, capacity, compiled=compiled, compiled_prefill=compiled_prefill)
    vocab = target.embed_tokens.weight.shape[0]
    ids = torch.randint(0, vocab, (rows, prompt), generator=torch.Generator().manual_seed(0)).to(target.device)
    every_row, last = torch.arange(rows, device=target.device), torch.full((rows,), prompt - 1, device=target.device)

    def prefill():
        return static.extend_rows(ids, every_row, 0, last)

    choice = prefill()  # the first one warms the kernels up (and compiles them, with compiled_prefill)
    synchronize(target.device)
    start = time.perf_counter()
    for _ in range(PREFILL_REPEATS):
        choice = prefill()
    synchronize(target.device)
    prefill_seconds = (time.perf_counter() - start) / PREFILL_REPEATS
    columns = torch.full((rows,), prompt, device=target.device)
    column = prompt

    def step(choice):
        nonlocal column
        choice = static.step_rows(choice, columns, column + 1)
        columns.add_(1)
        column += 1
        return choice

    for _ in range(3):  # graph captures of the spans ahead
        choice = step(choice)
    synchronize(target.device)
    start = time.perf_counter()
    for _ in range(steps):
        choice = step(choice)
    synchronize(target.device)
    seconds = (time.perf_counter() - start) / steps
    result = {"rows": rows, "capacity": static.capacity, "prompt": prompt,
              "prefill_ms": round(prefill_seconds * 1e3, 3), "prefill_tokens_per_second": round(rows * prompt / prefill_seconds),
              "ms_per_step": round(seconds * 1e3, 3), "row_steps_per_second": round(rows / seconds)}
    if profile:
        result["prefill_profile"] = kernel_table(target, prefill)
        static.graphs.enabled = False  # kernels show one by one outside a graph

        def five_steps():
            nonlocal choice
            for _ in range(5):
                choice = step(choice)

        result["profile"] = kernel_table(target, five_steps)
    return result


@torch.no_grad()
def time_engine(target: FrozenTarget, prompts: dict[int, list[int]], max_new_tokens: int, stop_ids: set[int],
                batch_tokens: int, compiled: bool = False) -> dict:
    """The engine over these prompts, from the first prefill to the last reply."""
    captures, capture_seconds = GraphReplays.captures, GraphReplays.capture_seconds
    synchronize(target.device)
    start = time.perf_counter()
    new_tokens, stopped = 0, 0
    for _, replies in generate_batches(target, prompts, max_new_tokens, stop_ids, batch_tokens,
                                                compiled=compiled):
        new_tokens += sum(len(tokens) for tokens, _ in replies)
        stopped += sum(finish == "stop" for _, finish in replies)
    synchronize(target.device)
    seconds = time.perf_counter() - start
    return {"prompts": len(prompts), "prompt_tokens": sum(map(len, prompts.values())), "new_tokens": new_tokens,
            "stopped": stopped, "seconds": round(seconds, 2), "new_tokens_per_second": round(new_tokens / seconds),
            "conversations_per_second": round(len(prompts) / seconds, 1),
            "graph_captures": GraphReplays.captures - captures,
            "capture_seconds": round(GraphReplays.capture_seconds - capture_seconds, 2)}


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
    prompts: str | None = field(default=None, metadata={
        "help": "chat JSONL: time the whole engine on its prompts (what dflash.regenerate --engine fast runs)"})
    limit: int = field(default=4000, metadata={"help": "with --prompts: the first N conversations (0: all)"})
    max_new_tokens: int = 384
    batch_tokens: int = field(default=0, metadata={"help": "with --prompts: 0 sizes the batch from memory"})
    shapes: str = field(default="1024x1024x600,341x3072x2400",
                        metadata={"help": "rows x capacity x prompt, comma-separated"})
    steps: int = 50
    profile: bool = field(default=False, metadata={"help": "also list the kernels that take the step's time"})
    compile_target: bool = field(default=False, metadata={
        "help": "the graphed steps run the target's layers compiled (as batch-1 decoding does); "
                "regeneration runs them eager"})
    compile_prefill: bool = field(default=False, metadata={
        "help": "--shapes: the prefill's layer functions compiled once for every shape (regeneration runs them eager)"})
    dtype: str = "bfloat16"
    device: str = "auto"
    output: str | None = field(default=None, metadata={"help": "also write the results as JSON here"})


def main(argv: list[str] | None = None) -> int:
    (args,) = cli_parser(RegenStepArgs).parse_args_into_dataclasses(argv)
    setup_logging(0)
    folder = resolve_target(args.target)
    target = FrozenTarget.load(folder, [0], getattr(torch, args.dtype), pick_device(args.device, 0))
    results = []
    if args.prompts:
        tokenizer = load_tokenizer(folder)
        conversations = load_chat_jsonl(args.prompts, require_reply=False)[: args.limit or None]
        prompts = dict(enumerate(many_prompt_ids(tokenizer, conversations)))
        result = time_engine(target, prompts, args.max_new_tokens, stop_token_ids(target.model.generation_config, tokenizer),
                             args.batch_tokens, args.compile_target)
        logger.info("%d prompts (%d tokens): %d new tokens in %.1f s, %d new tokens/s, %.1f conversations/s "
                    "(%d CUDA graph captures, %.1f s)", result["prompts"], result["prompt_tokens"],
                    result["new_tokens"], result["seconds"], result["new_tokens_per_second"],
                    result["conversations_per_second"], result["graph_captures"], result["capture_seconds"])
        results.append(result)
    else:
        for rows, capacity, prompt in parse_shapes(args.shapes):
            result = time_steps(target, rows, capacity, prompt, args.steps, args.profile,
                                args.compile_target, args.compile_prefill)
            logger.info("rows %d x %d columns, prompt %d: prefill %.1f ms (%d tokens/s); %.2f ms per step, %d row-steps/s",
                        rows, result["capacity"], prompt, result["prefill_ms"], result["prefill_tokens_per_second"],
                        result["ms_per_step"], result["row_steps_per_second"])
            if "profile" in result:
                logger.info("prefill:\n%s\ndecode step:\n%s", result["prefill_profile"], result["profile"])
            results.append(result)
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
