"""Exact tau while training: every --eval-every steps, the drafter is scored on the held-out
prompts' greedy continuations (computed once, at start) with one teacher-forced forward per
prompt, and the chain decoding would walk gives tau (dflash.eval.evaluate.teacher_forced). No decoding
loop, so it costs a few forwards; it needs the target on the rank, i.e. colocated placement.

The same walk over as many TRAINING samples (their regenerated replies are the target's own
continuations) gives `train_tau`: far above the held-out tau, the drafter memorises its data
rather than learning the target, a cause of low acceptance that training accuracy hides.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from dflash.data.dataset import TokenDataset
from dflash.eval.evaluate import continuation, eos_token_ids, load_prompts, teacher_forced
from dflash.eval.speculative import Decoder, resolve_decoder
from dflash.target.frozen import FrozenTarget

logger = logging.getLogger(__name__)



def memorising(train_tau: float, heldout_tau: float) -> bool:
    """Drafts accepted per cycle (tau - 1) on training samples more than twice the held-out
    ones, and by at least 0.1: the drafter fits its samples, not the target. (A drafter fitted
    to 8 demo samples for 60 steps: 0.25 against 0.02, tests/unit/eval/test_eval_tau.py.)"""
    return train_tau - 1 > 2 * (heldout_tau - 1) + 0.1


def training_sequences(dataset: TokenDataset, count: int, max_new_tokens: int) -> list[tuple[list[int], list[int], int]]:
    """(prompt, reply, reply length) of the first `count` training samples, in the form
    teacher_forced takes: the prompt is everything before the first trained token, the reply the
    run of trained tokens from there (a later reply of the sample, past a user turn, is not part of
    it: blocks never cross into it in training either). Replies are cut to the held-out
    continuations' length: later tokens of long replies (repetition loops, often) are easier to
    draft, and would pass for memorisation."""
    sequences = []
    for index in range(min(count, len(dataset))):
        ids, mask = dataset[index]
        first = int(mask.argmax())
        run = int(np.logical_and.accumulate(mask[first:]).sum())
        reply = ids[first:first + min(run, max_new_tokens)].tolist()
        sequences.append((ids[:first].tolist(), reply, len(reply)))
    return sequences


class TauProbe:
    """The held-out prompts rendered in the run's resolved thinking mode (that of its data)."""

    def __init__(self, target: FrozenTarget, tokenizer, prompts_path: str, num_prompts: int, max_new_tokens: int,
                 block_size: int, dataset: TokenDataset | None = None, thinking: str = "none"):
        started = time.perf_counter()
        eos = eos_token_ids(tokenizer, target)
        prompts = load_prompts(prompts_path, tokenizer, num_prompts, thinking)
        self.target = target
        decoder = Decoder(target, None, max(map(len, prompts)) + max_new_tokens + block_size,
                          resolve_decoder("auto", target))
        self.sequences = [(p, *continuation(decoder, p, max_new_tokens, eos, block_size)) for p in prompts]
        self.train_sequences = training_sequences(dataset, len(prompts), max_new_tokens) if dataset is not None else []
        logger.info("periodic eval: greedy continuations of %d held-out prompts computed in %.1f s",
                    len(self.sequences), time.perf_counter() - started)

    def measure(self, drafter) -> dict:
        """tau (exact, teacher-forced) and acceptance by position, and what it cost."""
        started = time.perf_counter()
        training = drafter.training
        drafter.eval()
        result = teacher_forced(self.target, drafter, self.sequences)
        report = {"tau": result.tau, "acceptance": [round(a, 4) for a in result.acceptance]}
        if self.train_sequences:
            report["train_tau"] = teacher_forced(self.target, drafter, self.train_sequences).tau
        drafter.train(training)
        return {**report, "eval_seconds": time.perf_counter() - started}
