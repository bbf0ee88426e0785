"""Rows of a right-padded micro-batch split into groups of about one length for the target's forward.

A micro-batch of samples drawn at random from a length bucket is padded to its longest sample, and
the target computes every padded position: on the 39,081 Qwen2.5-Coder-0.5B replies at --max-tokens
32768, 64% of them are real. Run group by group, each cut to its own longest row, the same rows cost
fewer positions (4 groups: 88% real, 27% fewer; `python -m dflash.tools.data stats`), while the
drafter still trains on the micro-batch the sampler drew: its company of samples, and so what it
learns a step, is unchanged. It pays on a CPU; on an H100 the smaller forwards took longer than the
one padded forward (BENCHMARKS.md), so --target-length-groups is 1 unless asked.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# A group smaller than this many padded positions would trade the positions it saves for launches:
# the target's matmuls over it are too short to keep the GPU busy while the host queues the next.
MIN_GROUP_TOKENS = 4096
# A split must save at least this share of the micro-batch's padded positions to be worth its launches.
MIN_SAVING = 0.02
# Places a group may end at: every row of a micro-batch up to this many, evenly spaced ones beyond
# (a micro-batch of thousands of short rows plans in a fraction of a millisecond all the same).
SPLIT_PLACES = 128


@dataclass(frozen=True)
class LengthGroup:
    rows: np.ndarray  # indices into the micro-batch, longest first
    width: int  # the longest of their lengths: the group's padded width


def computed_positions(groups: list[LengthGroup]) -> int:
    """The positions the target computes for a plan: each group's rows x its width."""
    return sum(len(group.rows) * group.width for group in groups)


def plan_length_groups(lengths, max_groups: int, min_tokens: int | None = None) -> list[LengthGroup]:
    """At most `max_groups` groups of rows that together pad the fewest positions (rows x the group's
    longest), each of at least `min_tokens` padded positions (default MIN_GROUP_TOKENS); the fewest
    groups within MIN_SAVING of the best. Rows sorted by length, the best split into contiguous runs
    by dynamic programming over the places a run may end: every row up to SPLIT_PLACES rows, evenly
    spaced ones beyond."""
    lengths = np.asarray(lengths, dtype=np.int64)
    min_tokens = MIN_GROUP_TOKENS if min_tokens is None else min_tokens
    if max_groups < 1:
        raise ValueError(f"max_groups {max_groups}: use 1 (one forward over the padded micro-batch) or more")
    order = np.argsort(-lengths, kind="stable")
    ordered = lengths[order]
    n = len(ordered)
    if max_groups == 1 or n < 2:
        return [LengthGroup(order, int(ordered[0]) if n else 0)]
    places = np.unique(np.linspace(0, n, min(n, SPLIT_PLACES) + 1).round().astype(np.int64))
    # cost[a, b]: the rows from place a to place b as one group, padded to the first (longest) one
    first, last = places[:, None], places[None, :]
    cost = ((last - first) * ordered[np.minimum(first, n - 1)]).astype(np.float64)
    cost[(last <= first) | (cost < min_tokens)] = np.inf
    best = np.full(len(places), np.inf)
    best[0] = 0.0
    choices, totals = [], []
    for _ in range(max_groups):  # round k: the best split into exactly k + 1 groups
        candidates = best[:, None] + cost
        choices.append(candidates.argmin(axis=0))
        best = candidates.min(axis=0)
        totals.append(best[-1])
    whole = n * int(ordered[0])
    groups = next(k for k, total in enumerate(totals, 1) if total <= min(totals) + MIN_SAVING * whole)
    if groups == 1 or not np.isfinite(totals[groups - 1]):
        return [LengthGroup(order, int(ordered[0]))]
    spans, end = [], len(places) - 1
    for k in range(groups - 1, -1, -1):  # walk the choices back from the last place
        begin = int(choices[k][end])
        spans.append((int(places[begin]), int(places[end])))
        end = begin
    return [LengthGroup(order[a:b], int(ordered[a])) for a, b in reversed(spans)]
