"""The draft vocabulary: the drafter scores and drafts only the N tokens that the target writes
most often in the training replies, through those N rows of the target's lm_head (the reduced
draft vocabulary of EAGLE-3). On a small target the lm_head is half of a training step's FLOPs
(Qwen2.5-Coder-0.5B: 151,936 rows of 896); most of its rows are tokens its replies never hold.

A reply token outside the vocabulary is not scored in training and ends a streak: the drafter
cannot draft it, so the verify rejects the draft there, as it rejects any wrong draft, and
decoding stays exactly the target's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from dflash.drafter.objective import Blocks


def choose_draft_vocabulary(counts: np.ndarray, size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """Token ids [size], ascending: those of `always` (the end-of-turn token: drafting it ends a
    reply), then the most frequent by `counts` [vocab], ties to the lower id."""
    vocab = len(counts)
    if not 0 < size <= vocab:
        raise ValueError(f"a draft vocabulary of {size} tokens from a vocabulary of {vocab}: use 1 to {vocab}")
    priority = counts.astype(np.float64)
    priority[[i for i in always if 0 <= i < vocab]] = np.inf
    order = np.lexsort((np.arange(vocab), -priority))  # by count, high first; then by id
    return torch.from_numpy(np.sort(order[:size])).long()


def coverage(counts: np.ndarray, draft_to_target: torch.Tensor) -> float:
    """The share of the counted reply tokens that the vocabulary holds."""
    total = counts.sum()
    return float(counts[draft_to_target.numpy()].sum() / total) if total else 1.0


class DraftHead:
    """The lm_head a drafter scores with: the target's own, or (with a draft vocabulary,
    `draft_to_target` [N] ids) a copy of its N rows; `to_target` turns a row index back into the
    target's token id, `restrict` turns a micro-batch's labels into row indices."""

    def __init__(self, lm_head: torch.nn.Module, draft_to_target: torch.Tensor | None):
        self.draft_to_target = draft_to_target
        if draft_to_target is None:
            self.weight = lm_head.weight
            return
        ids = draft_to_target.to(lm_head.weight.device)
        self.draft_to_target = ids
        self.weight = lm_head.weight.detach()[ids]
        self.target_to_draft = torch.full((lm_head.weight.shape[0],), -1, dtype=torch.long, device=ids.device)
        self.target_to_draft[ids] = torch.arange(len(ids), device=ids.device)

    @classmethod
    def of(cls, drafter: torch.nn.Module, lm_head: torch.nn.Module | DraftHead) -> DraftHead:
        """The head `drafter` scores with, from the target's `lm_head` (or the head itself)."""
        if isinstance(lm_head, DraftHead):
            return lm_head
        return cls(lm_head, getattr(drafter, "draft_to_target", None))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)

    def to_target(self, rows: torch.Tensor) -> torch.Tensor:
        return rows if self.draft_to_target is None else self.draft_to_target[rows]

    def restrict(self, blocks: Blocks) -> Blocks:
        """Labels as row indices; a label outside the vocabulary is not scored."""
        if self.draft_to_target is None:
            return blocks
        rows = self.target_to_draft[blocks.labels]
        scored = blocks.label_mask & (rows >= 0)
        return dataclasses.replace(blocks, labels=torch.where(scored, rows, torch.zeros_like(rows)), label_mask=scored)
