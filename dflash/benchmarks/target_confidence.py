"""How sure a target is of its own greedy replies: at each reply position, the probability of
the token it chose and the margin to the runner-up. Where the target hesitates, a drafter that
only approximates it picks the other token, so a target unsure at many positions caps what any
drafter's acceptance can reach at those positions.

    python -m dflash.benchmarks.target_confidence --target model.gguf --prompts heldout.jsonl --num-prompts 12
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from dflash.benchmarks.decode import INPUT_ERRORS, load_for_decoding, write_report
from dflash.eval.speculative import Decoder
from dflash.target.frozen import FrozenTarget
from dflash.util.cli import cli_parser, user_error
from dflash.util.runtime import pick_device, setup_logging

THRESHOLDS = (0.3, 0.5, 0.7, 0.9)
SMALL_MARGIN = 0.1


@dataclass
class ConfidenceArgs:
    target: str
    prompts: str = field(metadata={"help": "chat JSONL; the last user turn of each is the prompt"})
    tokenizer: str | None = None
    num_prompts: int = 12
    max_new_tokens: int = 128
    dtype: str = "float32"
    device: str = "auto"
    output: str | None = None


@torch.no_grad()
def confidence(target: FrozenTarget, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int]) -> dict:
    """Over every greedy reply token of `prompts`: the mean probability of the chosen token, the
    share of positions where it is below each of THRESHOLDS, and where it leads the runner-up by
    less than SMALL_MARGIN."""
    decoder = Decoder(target, None, max(map(len, prompts)) + max_new_tokens, "auto")
    chosen, margins = [], []
    for prompt in prompts:
        reply = decoder.greedy(prompt, max_new_tokens, eos_ids).tokens
        ids = torch.tensor([prompt + reply], device=target.device)
        logits = target.model(ids).logits[0, len(prompt) - 1: -1].float()  # the ones that chose the reply
        top2 = logits.softmax(-1).topk(2, dim=-1).values
        chosen.append(top2[:, 0])
        margins.append(top2[:, 0] - top2[:, 1])
    p, margin = torch.cat(chosen), torch.cat(margins)
    return {"positions": len(p), "mean_chosen_probability": round(float(p.mean()), 4),
            "share_below": {str(t): round(float((p < t).double().mean()), 4) for t in THRESHOLDS},
            f"share_margin_below_{SMALL_MARGIN}": round(float((margin < SMALL_MARGIN).double().mean()), 4)}


def main(argv: list[str] | None = None) -> int:
    (args,) = cli_parser(ConfidenceArgs).parse_args_into_dataclasses(argv)
    setup_logging(0)
    try:
        target, _, prompts, eos = load_for_decoding(args.target, args.tokenizer, args.prompts, args.num_prompts, 1,
                                                    args.dtype, pick_device(args.device, 0))
    except INPUT_ERRORS as err:
        return user_error(err)
    write_report(confidence(target, prompts, args.max_new_tokens, eos), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
