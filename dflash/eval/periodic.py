"""Exact tau while training: every --eval-every steps, the drafter is scored on the held-out
prompts' greedy continuations with one teacher-forced forward per prompt, and the chain decoding
would walk gives tau (dflash.eval.evaluate.teacher_forced). No decoding loop, so it costs a few
forwards. The continuations and the target's features of them are computed once, at start, by a
rank that holds the target (probe_sequences); in split mode a target rank sends them to the
drafter rank that measures (dflash/training/run_report.py), which holds the target's embedding and
lm_head but not its layers.

The same walk over as many TRAINING samples (their regenerated replies are the target's own
continuations) gives `train_tau`: far above the held-out tau, the drafter memorises its data
rather than learning the target, a cause of low acceptance that training accuracy hides.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

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


Sequence = tuple[list[int], list[int], int]  # (prompt, continuation, reply tokens decoding keeps)


@dataclass
class ProbeSequences:
    """The periodic eval's sequences and the target's features of each ([1, S, F], on the CPU)."""

    heldout: list[Sequence]
    heldout_features: list[torch.Tensor]
    train: list[Sequence]
    train_features: list[torch.Tensor]


@torch.no_grad()
def probe_sequences(target: FrozenTarget, tokenizer, prompts_path: str, num_prompts: int, max_new_tokens: int,
                    block_size: int, dataset: TokenDataset | None = None, thinking: str = "none") -> ProbeSequences:
    """The held-out prompts (rendered in the run's resolved thinking mode, that of its data), the
    target's greedy continuations of them, as many training samples, and the features of all."""
    started = time.perf_counter()
    eos = eos_token_ids(tokenizer, target)
    prompts = load_prompts(prompts_path, tokenizer, num_prompts, thinking)
    decoder = Decoder(target, None, max(map(len, prompts)) + max_new_tokens + block_size,
                      resolve_decoder("auto", target))
    heldout = [(p, *continuation(decoder, p, max_new_tokens, eos, block_size)) for p in prompts]
    train = training_sequences(dataset, len(prompts), max_new_tokens) if dataset is not None else []

    def features(sequences: list[Sequence]) -> list[torch.Tensor]:
        return [target.features(torch.tensor([p + r], device=target.device)).features.cpu() for p, r, _ in sequences]

    probe = ProbeSequences(heldout, features(heldout), train, features(train))
    logger.info("periodic eval: greedy continuations of %d held-out prompts and the target's features computed in "
                "%.1f s", len(heldout), time.perf_counter() - started)
    return probe


class TauProbe:
    """Measures a drafter on ProbeSequences, with the target's embedding and lm_head."""

    def __init__(self, probe: ProbeSequences, embed_tokens: torch.nn.Module, lm_head: torch.nn.Module):
        self.probe, self.embed_tokens, self.lm_head = probe, embed_tokens, lm_head
        self.sequences, self.train_sequences = probe.heldout, probe.train

    def _walk(self, drafter, sequences: list[Sequence], features: list[torch.Tensor]):
        device = self.embed_tokens.weight.device
        return teacher_forced(drafter, self.embed_tokens, self.lm_head, sequences,
                              lambda index, _: features[index].to(device, non_blocking=True))

    def measure(self, drafter) -> dict:
        """tau (exact, teacher-forced) and acceptance by position, and what it cost."""
        started = time.perf_counter()
        training = drafter.training
        drafter.eval()
        result = self._walk(drafter, self.probe.heldout, self.probe.heldout_features)
        report = {"tau": result.tau, "acceptance": [round(a, 4) for a in result.acceptance], "heldout_ce": result.ce}
        if self.probe.train:
            report["train_tau"] = self._walk(drafter, self.probe.train, self.probe.train_features).tau
        drafter.train(training)
        return {**report, "eval_seconds": time.perf_counter() - started}
