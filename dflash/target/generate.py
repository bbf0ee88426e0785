"""Batched generation on the static-cache target (dflash.target.static), the regeneration
engine when vLLM is absent: prompts of similar length share a batch, left-padded to the longest,
and each new token of every row is one CUDA-graph replay. Greedy, or sampled with the target's
settings (dflash.target.sampling)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from dflash.target.frozen import FrozenTarget
from dflash.target.sampling import Sampling
from dflash.target.static import StaticTarget, round_up

STOP_CHECK_EVERY = 16  # steps between the host syncs that ask which rows have stopped
# Rows whose reply has ended are dropped from the batch once at least a tenth of it has ended
# (ShareGPT at 384 new tokens: a reply ends at 295 tokens on average, so a batch that always ran
# all rows to its longest reply would spend a fifth of its work on finished ones). The rows kept
# are rounded up to ROW_STEP, stopped ones filling in, so a batch is captured in few shapes.
DROP_WHEN_STOPPED = 0.1
ROW_STEP = 32
# A batch's cache is its longest prompt + max_new_tokens rounded up to this: short prompts get
# many more rows than the longest one would allow (ShareGPT turns: median 446 tokens, longest
# 2.5K), while a new cache and its graph captures are made only when the rounded size changes.
CAPACITY_STEP = 512


def generate_batches(target: FrozenTarget, prompts: dict[int, list[int]], max_new_tokens: int, stop_ids: set[int],
                     batch_tokens: int, sampling: Sampling | None = None) -> Iterator[tuple[list[int], list[list[int]]]]:
    """Yields (indices, each row's new tokens up to its first stop, excluded), longest
    prompts first. A batch holds rows x (its longest prompt + max_new_tokens, rounded up to
    CAPACITY_STEP) within batch_tokens; the longest prompts come first, so an out-of-memory
    shows at the first batch."""
    order = sorted(prompts, key=lambda i: (-len(prompts[i]), i))
    static = None
    first = 0
    while first < len(order):
        capacity = round_up(len(prompts[order[first]]) + max_new_tokens, CAPACITY_STEP)
        rows = max(1, min(len(order) - first, batch_tokens // capacity))
        if static is None or (static.batch, static.capacity) != (rows, capacity):
            static = None  # the old cache and graphs go before the new ones are allocated
            static = StaticTarget(target, rows, capacity, sampling=sampling)
        batch = order[first: first + rows]
        first += rows
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
    stopped[len(prompts):] = True  # the repeated rows are dropped with the first finished ones
    owner = torch.arange(len(rows), device=device)  # the prompt each cache row decodes
    made = 1
    while made < max_new_tokens:
        if made % STOP_CHECK_EVERY == 0:
            live = int((~stopped).sum())
            if live == 0:
                break
            kept = min(round_up(live, ROW_STEP), static.batch)
            if live <= (1 - DROP_WHEN_STOPPED) * static.batch and kept < static.batch:
                # live rows first, then stopped ones (their tokens land past their stop, unread)
                keep = torch.argsort(stopped.to(torch.int8), stable=True)[:kept]
                static.keep_rows(keep)
                choice, stopped, owner = choice[keep], stopped[keep], owner[keep]
        choice, _ = static.step(choice, width + made - 1)
        new[owner, made] = choice[:, 0]
        stopped |= torch.isin(choice[:, 0], stops)
        made += 1
    replies = []
    for row in new[: len(prompts), :made].tolist():
        end = next((i for i, token in enumerate(row) if token in stop_ids), len(row))
        replies.append(row[:end])
    return replies
