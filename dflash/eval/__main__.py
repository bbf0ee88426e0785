"""Judge a drafter by real speculative decoding on held-out prompts.

    python -m dflash.eval --drafter runs/demo/drafter          # demo target and prompts
    python -m dflash.eval --target T --drafter D --prompts heldout.jsonl
    python -m dflash.eval --target T --drafter D --max-new-tokens 128 384 --output eval.json  # eval_128.json, eval_384.json

Reports tau (tokens per target forward during drafting cycles, bonus token included),
per-position acceptance, wall-clock speedup over plain greedy decoding of the same target,
and, on the same prompts and the target's own continuations, the teacher-forced streak that
training logs (bonus NOT included: compare tau with 1 + streak). The decoded text must equal
plain greedy decoding; the command fails if it does not. Prompts are rendered in the --thinking
mode, which must be the one the drafter was trained in (its config.json records it).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from dflash.config import EVAL_FLAGS, check_eval_flags
from dflash.data.chat_formats import DataError
from dflash.data.thinking import THINKING_HELP
from dflash.data.tokenization import load_tokenizer
from dflash.data.tokenizer_match import check_tokenizer_matches_target
from dflash.demo import DEMO_HELDOUT_DATA, DEMO_TARGET_DIR, require_demo_assets
from dflash.drafter.export import DrafterLoadError
from dflash.eval.evaluate import EvalRequest, check_lossless, evaluate_drafters, resolve_dtype, write_reports
from dflash.eval.speculative import DECODERS
from dflash.target.frozen import TargetError
from dflash.util.cli import cli_parser, user_error
from dflash.util.runtime import pick_device, setup_logging


@dataclass
class EvalArgs:
    drafter: str = field(default="runs/demo/drafter", metadata={"help": "exported drafter folder"})
    target: str = field(default=str(DEMO_TARGET_DIR), metadata={
        "help": "HF causal-LM folder, or a .gguf file (de-quantized once into <file>.hf, or ~/.cache/dflash/)"})
    tokenizer: str | None = field(default=None, metadata={"help": "default: --target"})
    allow_tokenizer_mismatch: bool = field(default=False, metadata={
        "help": "evaluate although --tokenizer's special ids or vocabulary differ from --target's"})
    prompts: str = field(default=str(DEMO_HELDOUT_DATA), metadata={"help": "chat JSONL; the last assistant turn is dropped"})
    num_prompts: int = 16
    max_new_tokens: list[int] = field(default_factory=lambda: [96], metadata={
        "help": "new tokens per prompt; several (e.g. 128 384) judge each length in one process, which loads the "
                "target once and reuses the decoder's compiled steps and graphs, and write one report each"})
    device: str = "auto"
    dtype: str = field(default="float32", metadata={"help": "float32 (exact lossless check) | bfloat16 (serving speed) | "
                                                           "auto (bfloat16 on a GPU, float32 on the CPU)"})
    decoder: str = field(default="auto", metadata={"help": "fast (static KV caches, CUDA graphs on a GPU; Llama, "
                                                           "Mistral, Qwen2/3) | plain (HF forward, any family) | auto"})
    thinking: str = field(default="auto", metadata={"help": THINKING_HELP + " (a drafter that records another "
                                                                          "mode is refused)"})
    output: str | None = field(default=None, metadata={
        "help": "write the report as JSON here; with several --max-new-tokens, one per length, named with it "
                "(eval.json: eval_128.json, eval_384.json)"})


EVAL_ERRORS = (DataError, DrafterLoadError, TargetError, ValueError)


def main(argv: list[str] | None = None) -> int:
    (args,) = cli_parser(EvalArgs).parse_args_into_dataclasses(argv)
    setup_logging(0)
    try:
        if args.target == str(DEMO_TARGET_DIR) or args.prompts == str(DEMO_HELDOUT_DATA):  # the defaults
            require_demo_assets("--target, --drafter and --prompts")
        for length in args.max_new_tokens:
            check_eval_flags(args.prompts, args.num_prompts, length, args.dtype, EVAL_FLAGS, min_prompts=1)
        if args.decoder not in DECODERS:
            raise ValueError(f"--decoder {args.decoder}: use one of {', '.join(DECODERS)}")
        tokenizer = args.tokenizer or args.target
        check_tokenizer_matches_target(load_tokenizer(tokenizer), args.target, tokenizer, args.allow_tokenizer_mismatch)
        device = pick_device(args.device, 0)
        request = EvalRequest(args.target, tokenizer, args.prompts, args.num_prompts, max(args.max_new_tokens),
                              resolve_dtype(args.dtype, device), args.decoder, args.thinking)
        reports = evaluate_drafters(request, {"drafter": args.drafter}, device, args.max_new_tokens)
    except EVAL_ERRORS as err:
        return user_error(err)
    if args.output:
        for length, path in report_paths(args.output, args.max_new_tokens).items():
            write_reports(reports[length], path)
    return 0 if all([check_lossless(r) for r in reports.values()]) else 1  # each logs what it finds


def report_paths(output: str, lengths: list[int]) -> dict[int, Path]:
    """--output for one length; with several, the length joins each file's name."""
    path = Path(output)
    if len(set(lengths)) == 1:
        return {lengths[0]: path}
    return {length: path.with_name(f"{path.stem}_{length}{path.suffix}") for length in lengths}


if __name__ == "__main__":
    sys.exit(main())
