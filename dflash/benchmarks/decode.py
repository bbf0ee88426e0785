"""Batch-1 decoding speed of a target, HF's forward (plain) against the static-cache path
(fast): greedy tokens/s, and the cost of a speculative cycle with an untrained drafter of the
recipe's depth (its drafts are all rejected, so this times the machinery, not a drafter; the
cycle's cost in greedy steps is what a drafter's tau must exceed for a speed-up). Both paths
must produce the same greedy tokens. A greedy step and a cycle are timed in their loops, after
each prompt's prefill, and every ratio divides by that greedy step (`greedy_step` says which).
On the fast path the cycle's parts are also timed alone (`cycle_parts`): what a cycle costs
beyond their sum (`beyond_parts_ms`) is what the loop adds (the host's turn, caches evicted).
`--profile` also replays each part under torch.profiler (`fast_cycle_profile`): the kernels one
call runs, their summed device time, the costliest by name and every name's launches and time,
which tells a part bound by its kernel count (many kernels of a few microseconds) from one bound
by a few large ones.

    python -m dflash.benchmarks.decode --target T --prompts heldout.jsonl --output decode.json
    python -m dflash.benchmarks.decode --target assets/demo/target --prompts assets/demo/data/heldout.jsonl \
        --device cpu --dtype float32 --block-size 8 --draft-layers 3
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch

from dflash.config import RECIPE
from dflash.data.chat_formats import DataError
from dflash.data.tokenization import load_tokenizer
from dflash.drafter.model import DFlashDrafter, drafter_config
from dflash.eval.evaluate import eos_token_ids, load_prompts
from dflash.eval.speculative import Decoder
from dflash.target.frozen import FrozenTarget, TargetError, default_target_layer_ids, load_target_config
from dflash.target.gguf import resolve_target
from dflash.target.graphs import GraphReplays
from dflash.util.cli import cli_parser, user_error
from dflash.util.runtime import pick_device, setup_logging, synchronize

logger = logging.getLogger(__name__)

# a target or prompts file a decoding benchmark cannot use: one line naming it, exit status 2
INPUT_ERRORS = (DataError, TargetError)
GREEDY_STEP = "fast_greedy.ms_per_token: the fast greedy loop's time after each prompt's prefill, per token after the first"


@dataclass
class DecodeBenchmarkArgs:
    target: str
    prompts: str = field(metadata={"help": "chat JSONL; the last user turn of each is the prompt"})
    tokenizer: str | None = None
    num_prompts: int = 16
    plain_prompts: int = field(default=2, metadata={"help": "prompts for the (slow) plain path"})
    max_new_tokens: int = 128
    block_size: int = 16
    draft_layers: int = field(default=RECIPE["num_draft_layers"], metadata={
        "help": "the untrained drafter's depth (its cost is the point)"})
    draft_vocab: int = field(default=0, metadata={
        "help": "the untrained drafter's draft vocabulary (rows of its lm_head; 0: the target's): --preset small's is 32768"})
    compile_drafter: bool = field(default=True, metadata={
        "help": "compile the drafter's steps on the fast path (as decoding does); False times them eager"})
    compile_target: bool = field(default=True, metadata={
        "help": "compile the target's layers in the fast path's graphed steps (as decoding does); False: eager"})
    dtype: str = "bfloat16"
    device: str = "auto"
    output: str | None = None
    profile: bool = field(default=False, metadata={
        "help": "also replay each cycle part under torch.profiler: kernels per call, their device time, the costliest"})


def load_for_decoding(target_path: str, tokenizer_path: str | None, prompts_path: str, num_prompts: int,
                      num_features: int, dtype: str, device: torch.device):
    """What a decoding benchmark runs on: the target (a GGUF file de-quantized once) reading
    `num_features` layers, its config, the prompts and the ids that end a reply."""
    tokenizer = load_tokenizer(tokenizer_path or target_path)
    path = resolve_target(target_path)
    prompts = load_prompts(prompts_path, tokenizer, num_prompts)
    config = load_target_config(path)
    layers = default_target_layer_ids(config.num_hidden_layers, num_features)
    target = FrozenTarget.load(path, layers, getattr(torch, dtype), device)
    return target, config, prompts, eos_token_ids(tokenizer, target)


def write_report(report: dict, output: str | None) -> None:
    print(json.dumps(report))
    if output:
        with open(output, "w") as f:
            json.dump(report, f, indent=2)


def timed(decoder: Decoder, prompts: list[list[int]], max_new_tokens: int, eos: set[int], speculative: bool,
          warm_every_prompt: bool) -> dict:
    """Tokens/s (prefill included) and the time of a greedy token (`ms_per_token`) or of a
    speculative cycle (`ms_per_cycle`) after each prompt's prefill, once warm: the fast path
    first decodes every prompt untimed, so that the CUDA graph of each span of columns they reach
    is captured (each capture costs tens of milliseconds) and each prompt length was seen."""
    run = decoder.speculative if speculative else decoder.greedy
    for prompt in prompts if warm_every_prompt else prompts[:1]:
        run(prompt, max_new_tokens if warm_every_prompt else 4, eos)
    results = [run(p, max_new_tokens, eos) for p in prompts]
    tokens = sum(len(r.tokens) for r in results)
    seconds = sum(r.seconds for r in results)
    prefill = sum(r.prefill_seconds for r in results)
    report = {"prompts": len(prompts), "tokens": tokens, "seconds": round(seconds, 3),
              "tokens_per_second": round(tokens / seconds, 1), "prefill_ms": round(1000 * prefill / len(results), 3)}
    if speculative:
        cycles = sum(r.target_forwards for r in results)
        report["ms_per_cycle"] = round(1000 * (seconds - prefill) / max(cycles, 1), 3)
    else:  # a prompt's first token comes with its prefill
        report["ms_per_token"] = round(1000 * (seconds - prefill) / max(tokens - len(results), 1), 3)
    return report, [r.tokens for r in results]


@torch.no_grad()
def cycle_part_calls(decoder: Decoder, prompt: list[int]) -> dict[str, Callable[[], object]]:
    """The parts of a speculative cycle as calls that can be replayed in a row after the prompt:
    the drafter's first proposal, the target's verify of B tokens, the drafter's advance (take the
    B tokens' features, accept, propose the next block), and, for scale, one greedy step."""
    device = decoder.target.device
    session, draft = decoder.session, decoder.draft
    choice, features = session.prefill(torch.tensor([prompt], device=device))
    draft.extend(features, 0)
    anchor, token = len(prompt), choice[0, -1:].clone()
    proposal = draft.start(token, anchor).clone()
    block_choice, block_features = (t.clone() for t in session.step(proposal, anchor))
    outcome = torch.cat([proposal[0, 1:], block_choice[0]])
    return {"propose": lambda: draft.start(token, anchor),
            "verify": lambda: session.step(proposal, anchor),
            "advance": lambda: draft.advance(outcome, block_features, anchor),
            "greedy_step": lambda: session.step(proposal[:, :1], anchor)}


@torch.no_grad()
def cycle_parts(calls: dict[str, Callable[[], object]], device: torch.device, repeats: int = 200) -> dict:
    """ms per call of each part, replayed `repeats` times in a row (the GPU runs them back to
    back, so this is their device cost)."""
    report = {}
    for name, run in calls.items():
        run()  # capture
        synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        synchronize(device)
        report[f"{name}_ms"] = round(1000 * (time.perf_counter() - start) / repeats, 3)
    return report


@torch.no_grad()
def kernel_profile(calls: dict[str, Callable[[], object]], device: torch.device, repeats: int = 20,
                   top: int = 6) -> dict:
    """Each part's replays under torch.profiler: on a GPU the kernels its CUDA graph runs, on
    the CPU its top-level ATen ops (`summarize_work`)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    report = {}
    for name, run in calls.items():
        run()  # capture
        synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as profiler:
            for _ in range(repeats):
                run()
            synchronize(device)
        work = [(event.name, event.time_range.elapsed_us()) for event in profiler.events()
                if (event.device_type == DeviceType.CUDA if cuda else event.cpu_parent is None)]
        report[name] = summarize_work(work, repeats, top)
    return report


def summarize_work(work: list[tuple[str, float]], calls: int, top: int) -> dict:
    """(name, microseconds) of every kernel `calls` calls ran -> per call: how many, their summed
    time, the `top` names that cost most, and every name's launches and time (`every_kernel`,
    costliest first: where a part's kernel count comes from)."""
    by_name: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    for name, us in work:
        by_name[name] += us
        launches[name] += 1
    ranked = sorted(by_name.items(), key=lambda item: -item[1])
    return {"kernels_per_call": round(len(work) / calls, 1),
            "kernel_ms_per_call": round(sum(us for _, us in work) / calls / 1000, 4),
            "costliest_ms_per_call": {name[:100]: round(us / calls / 1000, 4) for name, us in ranked[:top]},
            "every_kernel": [[name[:160], round(launches[name] / calls, 1), round(us / calls / 1000, 4)]
                             for name, us in ranked]}


def main(argv: list[str] | None = None) -> int:
    parser = cli_parser(DecodeBenchmarkArgs)
    (args,) = parser.parse_args_into_dataclasses(argv)
    if not 1 <= args.plain_prompts <= args.num_prompts:
        parser.error(f"--plain-prompts {args.plain_prompts}: use 1..--num-prompts ({args.num_prompts}); the "
                     "plain path's tokens and speed are what the fast path is compared with")
    if args.draft_layers < 1:
        parser.error(f"--draft-layers {args.draft_layers}: use 1 or more (the drafter whose cycle is timed)")
    if args.draft_vocab < 0:
        parser.error(f"--draft-vocab {args.draft_vocab}: use 0 (the target's vocabulary) or a row count")
    setup_logging(0)
    device = pick_device(args.device, 0)
    try:
        target, config, prompts, eos = load_for_decoding(args.target, args.tokenizer, args.prompts, args.num_prompts,
                                                         RECIPE["num_target_features"], args.dtype, device)
    except INPUT_ERRORS as err:
        return user_error(err)
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config(config, args.draft_layers, target.layer_ids, args.block_size, 0,
                                           draft_vocab=min(args.draft_vocab, config.vocab_size))).to(
        device, getattr(torch, args.dtype))
    capacity = max(map(len, prompts)) + args.max_new_tokens + args.block_size
    report = {"target": args.target, "dtype": args.dtype, "device": torch.cuda.get_device_name(device)
              if device.type == "cuda" else "cpu", "max_new_tokens": args.max_new_tokens,
              "draft_layers": args.draft_layers, "draft_vocab": args.draft_vocab, "compile_drafter": args.compile_drafter,
              "compile_target": args.compile_target}
    tokens = {}
    for kind, count in (("plain", args.plain_prompts), ("fast", args.num_prompts)):
        decoder = Decoder(target, drafter.eval(), capacity, kind, args.compile_drafter, args.compile_target)
        fast = kind == "fast"
        report[f"{kind}_greedy"], tokens[kind] = timed(decoder, prompts[:count], args.max_new_tokens, eos, False, fast)
        report[f"{kind}_speculative"], _ = timed(decoder, prompts[:count], args.max_new_tokens, eos, True, fast)
        logger.info("%s: greedy %s | speculative (untrained drafter) %s", kind, report[f"{kind}_greedy"],
                    report[f"{kind}_speculative"])
    calls = cycle_part_calls(decoder, prompts[0])
    parts = report["fast_cycle_parts"] = cycle_parts(calls, device)
    cycle = report["fast_speculative"]["ms_per_cycle"]
    parts["beyond_parts_ms"] = round(cycle - parts["verify_ms"] - parts["advance_ms"], 3)
    logger.info("fast cycle parts: %s", parts)
    if args.profile:
        report["fast_cycle_profile"] = kernel_profile(calls, device)
        for name, summary in report["fast_cycle_profile"].items():  # every kernel: in the report
            logger.info("profile of %s: %s", name, {k: v for k, v in summary.items() if k != "every_kernel"})
    report["same_tokens"] = tokens["fast"][: args.plain_prompts] == tokens["plain"]
    report["greedy_speedup"] = round(report["fast_greedy"]["tokens_per_second"]
                                     / report["plain_greedy"]["tokens_per_second"], 2)
    # One greedy step for every ratio: what the greedy loop achieves, not a step replayed alone.
    # A drafter speeds decoding up only where its tau exceeds cycle_in_greedy_steps.
    report["greedy_step"] = GREEDY_STEP
    report["greedy_step_ms"] = report["fast_greedy"]["ms_per_token"]
    report["cycle_in_greedy_steps"] = round(cycle / report["greedy_step_ms"], 2)
    report["graph_captures"], report["graph_capture_seconds"] = GraphReplays.captures, round(
        GraphReplays.capture_seconds, 1)  # one-off, outside the timings
    write_report(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
