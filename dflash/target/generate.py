"""Batched generation on the static-cache target (dflash.target.static), the regeneration engine
when vLLM is absent, with continuous batching: every cache row decodes its own prompt, and a row
whose reply has ended takes the next prompt at once (its prompt is prefilled into that row while
the other rows keep their place), so no row waits for the batch's longest reply. Each decode
step is one CUDA-graph replay for the whole batch. Greedy, or sampled with the target's settings
(dflash.target.sampling).

Prompts run longest first. The cache's rows and a prefill's chunk come from the target's shapes
and the free memory (dflash.target.memory); a cache is sized for the longest prompt left, and a
smaller one with more rows replaces it once the prompts left would fit REPHASE_GAIN times the
rows (the rows of the old one finish first).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator

import numpy as np
import torch

from dflash.target.frozen import FrozenTarget
from dflash.target.memory import BatchPlan, TargetShapes, free_device_bytes, plan_batch
from dflash.target.sampling import Sampling
from dflash.target.static import StaticTarget, round_up
from dflash.util.phases import PhaseClock

logger = logging.getLogger(__name__)

Reply = tuple[list[int], str]  # the new token ids (with the stop token that ended them), "stop" | "length"

STOP_CHECK_EVERY = 16  # steps between the host syncs that collect finished replies and refill their rows
# A cache holds its longest prompt + max_new_tokens (+ the steps a finished row may run before the
# check that sees it) rounded up to this: a new cache and its graph captures come only when the
# rounded size changes.
CAPACITY_STEP = 512
REPHASE_GAIN = 2.0
# Once no prompt is left, the batch shrinks to the rows still decoding (rounded up to ROW_STEP)
# whenever at most this share of it is: a shrunk batch captures its CUDA graphs again, so a
# draining batch of 4,096 rows shrinks some 7 times, not 40.
SHRINK_WHEN_LIVE = 0.5
ROW_STEP = 32


def stop_token_ids(generation_config, tokenizer) -> set[int]:
    """The ids that end a reply: the generation config's eos ids and the tokenizer's."""
    eos = generation_config.eos_token_id
    stop_ids = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}
    stop_ids.discard(None)
    return stop_ids


def capacity_for(prompt_tokens: int, max_new_tokens: int) -> int:
    return round_up(prompt_tokens + max_new_tokens + STOP_CHECK_EVERY, CAPACITY_STEP)


def phases(lengths: list[int], max_new_tokens: int, rows_at: Callable[[int], int]) -> list[tuple[int, int]]:
    """(capacity, prompt count) of each cache, for prompt lengths sorted longest first:
    a cache serves the prompts after its first until one whose own cache would hold at least
    REPHASE_GAIN times its rows (`rows_at(capacity)`)."""
    out = []
    first = 0
    while first < len(lengths):
        capacity = capacity_for(lengths[first], max_new_tokens)
        rows = rows_at(capacity)
        end = first + 1
        while end < len(lengths) and rows_at(capacity_for(lengths[end], max_new_tokens)) < REPHASE_GAIN * rows:
            end += 1
        out.append((capacity, end - first))
        first = end
    return out


def prefill_chunks(lengths: list[int], max_tokens: int, max_rows: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Prompts (in this order) cut into prefill forwards of at most `max_tokens` padded tokens
    (rows x the group's longest, rounded up to 16) and `max_rows` rows: (first, end, column
    windows). A prompt longer than max_tokens forms a group of its own, prefilled in windows of
    max_tokens columns (a multiple of 16)."""
    chunks = []
    first = 0
    while first < len(lengths):
        width = round_up(lengths[first], 16)
        end = first + 1
        while (end < len(lengths) and end - first < max_rows
               and (end - first + 1) * max(width, round_up(lengths[end], 16)) <= max_tokens):
            width = max(width, round_up(lengths[end], 16))
            end += 1
        windows = [(start, min(start + max_tokens, width)) for start in range(0, width, max_tokens)]
        chunks.append((first, end, windows))
        first = end
    return chunks


def generate_batches(target: FrozenTarget, prompts: dict[int, list[int]], max_new_tokens: int, stop_ids: set[int],
                     batch_tokens: int = 0, sampling: Sampling | None = None, compiled: bool = False,
                     ) -> Iterator[tuple[list[int], list[Reply]]]:
    """Yields (indices, replies) as replies end, every STOP_CHECK_EVERY steps: a reply is the
    target's new token ids, up to and including the first stop token ("stop"), or its first
    max_new_tokens ("length"). `batch_tokens` (rows x cache columns), when set, caps the rows
    the free memory allows. `compiled`: the decode steps run the target's layers compiled (StaticTarget);
    off by default, as each new batch shape compiles and captures again, which costs more than the
    fused step saves (BENCHMARKS.md "Qwen2.5-Coder-0.5B")."""
    shapes = TargetShapes.of(target.model.config, target.embed_tokens.weight.dtype)
    free = free_device_bytes(target.device)  # before any cache: each one replaces the last
    plans: dict[int, BatchPlan] = {}

    def plan(capacity: int) -> BatchPlan:
        if capacity not in plans:
            plans[capacity] = plan_batch(shapes, free, capacity, batch_tokens, sampling is not None)
        return plans[capacity]

    order = sorted(prompts, key=lambda i: (-len(prompts[i]), i))
    first = 0
    for capacity, count in phases([len(prompts[i]) for i in order], max_new_tokens, lambda c: plan(c).rows):
        chosen = plan(capacity)
        logger.info("%s; %d prompts of %d-%d tokens", chosen.report, count, len(prompts[order[first]]),
                    len(prompts[order[first + count - 1]]))
        batch = ContinuousBatch(target, min(chosen.rows, count), capacity, chosen, max_new_tokens, stop_ids,
                                sampling, compiled)
        yield from batch.run({i: prompts[i] for i in order[first:first + count]}, order[first:first + count])
        del batch  # its cache goes before the next one is allocated
        first += count


class ContinuousBatch:
    """The rows of one cache and what each decodes: the prompt it serves, the column its next
    token goes to, its reply so far (on the device, read back only when it has ended)."""

    def __init__(self, target: FrozenTarget, rows: int, capacity: int, plan: BatchPlan, max_new_tokens: int,
                 stop_ids: set[int], sampling: Sampling | None, compiled: bool):
        self.static = StaticTarget(target, rows, capacity, sampling=sampling, compiled=compiled)
        self.plan, self.max_new_tokens, self.stop_ids = plan, max_new_tokens, stop_ids
        device = target.device
        self.stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)  # each row's next input token
        self.columns = torch.zeros(rows, dtype=torch.long, device=device)  # the column it goes to
        self.made = torch.zeros(rows, dtype=torch.long, device=device)  # reply tokens so far
        self.stopped = torch.zeros(rows, dtype=torch.bool, device=device)  # a stop token among them
        self.live = torch.zeros(rows, dtype=torch.long, device=device)  # 1: the row serves a prompt
        self.replies = torch.zeros(rows, max_new_tokens + STOP_CHECK_EVERY, dtype=torch.long, device=device)
        self.owner = [-1] * rows  # the prompt index each row serves
        self.host_columns = np.zeros(rows, dtype=np.int64)  # self.columns, known without a read-back
        self.host_live = np.zeros(rows, dtype=np.int64)
        # where the batch's time goes (CUDA events: nothing waits), logged when it ends
        self.clock = PhaseClock(device)
        self.steps, self.live_row_steps, self.prompt_tokens = 0, 0, 0
        # key columns the decode steps' attention read, and those inside a live row's context:
        # under the span mask every row reads the batch's span (the rest is padding past shorter
        # rows); with LiveColumns each row reads its own
        self.columns_read, self.columns_live = 0, 0

    @torch.no_grad()
    def run(self, prompts: dict[int, list[int]], order: list[int]) -> Iterator[tuple[list[int], list[Reply]]]:
        queue = deque(order)
        first_rows = self.static.batch
        self.fill(list(range(first_rows)), [queue.popleft() for _ in range(first_rows)], prompts)
        self.clock.mark("prefill")
        while self.host_live.any():
            for _ in range(STOP_CHECK_EVERY):
                self.step()
            self.clock.mark("decode")
            slots, replies = self.collect()
            self.clock.mark("collect")
            if slots:
                yield [self.owner[s] for s in slots], replies
            taken = [queue.popleft() for _ in range(min(len(slots), len(queue)))]
            self.fill(slots[:len(taken)], taken, prompts)
            self.release(slots[len(taken):])
            if not queue:
                self.drop_ended_rows()
            self.clock.mark("prefill")
        self.log_time_split(first_rows)

    def log_time_split(self, rows: int) -> None:
        """Where this cache's time went: prefilling prompts into rows (and shrinking the batch as
        it drains), decode steps (with their CUDA-graph captures), collecting ended replies."""
        split = self.clock.split()
        decode = split.get("decode", 0.0)
        logger.info("batch of %d rows x %d columns done: prefill %.1f s (%d prompt tokens, %.0f/s), decode %.1f s "
                    "(%d steps, %.2f ms a step, %.0f live rows a step on average, graph captures included; "
                    "%.0f%% of the key columns its attention read were a live row's context), collect %.1f s",
                    rows, self.static.capacity, split.get("prefill", 0.0),
                    self.prompt_tokens, self.prompt_tokens / max(split.get("prefill", 0.0), 1e-9), decode,
                    self.steps, 1e3 * decode / max(self.steps, 1), self.live_row_steps / max(self.steps, 1),
                    100 * self.columns_live / max(self.columns_read, 1), split.get("collect", 0.0))

    def step(self) -> None:
        self.steps += 1
        self.live_row_steps += int(self.host_live.sum())
        end = int(self.host_columns.max()) + 1
        self.columns_live += int((self.host_columns + 1) @ self.host_live)  # a row at column c reads c + 1 keys
        if self.static.live_columns:  # each row reads its own keys, a released row (column 0) one
            self.columns_read += int(self.host_columns.sum()) + self.static.batch
        else:
            self.columns_read += self.static.batch * self.static.attended_columns(end)
        choice = self.static.step_rows(self.ids, self.columns, end)
        self.replies.scatter_(1, self.made[:, None], choice)
        self.stopped |= torch.isin(choice[:, 0], self.stops)
        self.ids.copy_(choice)
        self.made += self.live
        self.columns += self.live
        self.host_columns += self.host_live

    def fill(self, slots: list[int], indices: list[int], prompts: dict[int, list[int]]) -> None:
        """Prefill these prompts into these rows, in chunks the memory plan allows; each row's
        first reply token is the prefill's choice."""
        if not slots:
            return
        device = self.static.target.device
        lengths = [len(prompts[i]) for i in indices]
        self.prompt_tokens += sum(lengths)
        for first, end, windows in prefill_chunks(lengths, self.plan.prefill_tokens, self.plan.prefill_rows):
            group = [prompts[i] for i in indices[first:end]]
            ids = torch.zeros(len(group), windows[-1][1], dtype=torch.long)
            for row, prompt in enumerate(group):
                ids[row, :len(prompt)] = torch.tensor(prompt)
            ids = ids.to(device)
            rows = torch.tensor(slots[first:end], device=device)
            last = torch.tensor(lengths[first:end], device=device) - 1
            choice = None
            for start, stop in windows:
                chunk = self.static.extend_rows(ids[:, start:stop], rows, start,
                                                (last - start).clamp(0, stop - start - 1))
                inside = ((last >= start) & (last < stop))[:, None]
                choice = chunk if choice is None else torch.where(inside, chunk, choice)
            self.ids[rows] = choice
            self.columns[rows] = last + 1
            self.made[rows] = 1
            self.replies[rows, 0] = choice[:, 0]
            self.stopped[rows] = torch.isin(choice[:, 0], self.stops)
            self.live[rows] = 1
        for slot, index, length in zip(slots, indices, lengths):
            self.owner[slot] = index
            self.host_columns[slot] = length
            self.host_live[slot] = 1

    def collect(self) -> tuple[list[int], list[Reply]]:
        """The rows whose reply has ended (a stop token, or max_new_tokens) and their replies."""
        ended = (self.stopped | (self.made >= self.max_new_tokens)) & (self.live > 0)
        slots = ended.nonzero()[:, 0]
        if not len(slots):
            return [], []
        tokens = self.replies[slots, :self.max_new_tokens]
        is_stop = torch.isin(tokens, self.stops)
        first_stop = torch.where(is_stop.any(1), is_stop.int().argmax(1), -1)
        replies = [(row, "length") if stop < 0 else (row[:stop + 1], "stop")
                   for row, stop in zip(tokens.tolist(), first_stop.tolist())]
        return slots.tolist(), replies

    def release(self, slots: list[int]) -> None:
        """Rows left without a prompt decode at column 0 from now on (unread, within the cache)."""
        if not slots:
            return
        rows = torch.tensor(slots, device=self.columns.device)
        self.live[rows] = 0
        self.columns[rows] = 0
        for slot in slots:
            self.owner[slot] = -1
            self.host_columns[slot] = 0
            self.host_live[slot] = 0

    def drop_ended_rows(self) -> None:
        """Once at most SHRINK_WHEN_LIVE of the batch still decodes, those rows move to the front
        and the batch shrinks to them (rounded up to ROW_STEP)."""
        live = int(self.host_live.sum())
        kept = min(round_up(max(live, 1), ROW_STEP), self.static.batch)
        if live > SHRINK_WHEN_LIVE * self.static.batch or kept >= self.static.batch:
            return
        order = np.argsort(-self.host_live, kind="stable")[:kept]
        keep = torch.from_numpy(order).to(self.columns.device)
        self.static.keep_rows(keep)
        for name in ("ids", "columns", "made", "stopped", "live", "replies"):
            setattr(self, name, getattr(self, name)[keep])
        self.owner = [self.owner[i] for i in order]
        self.host_columns, self.host_live = self.host_columns[order], self.host_live[order]
