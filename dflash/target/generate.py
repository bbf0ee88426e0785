"""Batched greedy generation on the static-cache target (dflash.target.static), the
regeneration engine when vLLM is absent: prompts of similar length share a batch, left-padded
to the longest, and each new token of every row is one CUDA-graph replay."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from dflash.target.frozen import FrozenTarget
from dflash.target.static import StaticTarget

STOP_CHECK_EVERY = 16  # steps between the host syncs that ask whether every row has stopped


def greedy_batches(target: FrozenTarget, prompts: dict[int, list[int]], max_new_tokens: int, stop_ids: set[int],
                   batch_tokens: int) -> Iterator[tuple[list[int], list[list[int]]]]:
    """Yields (indices, each row's new tokens up to its first stop, excluded), longest
    prompts first. One cache serves every batch: rows x (longest prompt + max_new_tokens)
    within batch_tokens, so an out-of-memory shows at the first batch."""
    capacity = max(map(len, prompts.values())) + max_new_tokens
    rows = max(1, min(len(prompts), batch_tokens // capacity))
    static = StaticTarget(target, rows, capacity)
    order = sorted(prompts, key=lambda i: (-len(prompts[i]), i))
    for first in range(0, len(order), rows):
        batch = order[first: first + rows]
        yield batch, generate(static, [prompts[i] for i in batch], max_new_tokens, stop_ids)


@torch.no_grad()
def generate(static: StaticTarget, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int]) -> list[list[int]]:
    device = static.target.device
    # A short batch repeats its last row: the cache and the captured graph have fixed shapes.
    rows = prompts + [prompts[-1]] * (static.batch - len(prompts))
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for row, prompt in enumerate(rows):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
    static.set_padding([width - len(p) for p in rows])
    choice, _ = static.prefill(ids.to(device))
    stops = torch.tensor(sorted(stop_ids), device=device)
    new = torch.empty(len(rows), max_new_tokens, dtype=torch.long, device=device)
    new[:, 0] = choice[:, 0]
    stopped = torch.isin(choice[:, 0], stops)
    made = 1
    while made < max_new_tokens and not (made % STOP_CHECK_EVERY == 0 and bool(stopped.all())):
        choice, _ = static.step(choice, width + made - 1)
        new[:, made] = choice[:, 0]
        stopped |= torch.isin(choice[:, 0], stops)
        made += 1
    replies = []
    for row in new[: len(prompts), :made].tolist():
        end = next((i for i, token in enumerate(row) if token in stop_ids), len(row))
        replies.append(row[:end])
    return replies
