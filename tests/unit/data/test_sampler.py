"""Tests for dflash.data.sampler: rank-aware bucketed micro-batches for data-parallel ranks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dflash.data.chat_formats import DataError
from dflash.data.sampler import RankAwareBucketSampler, balanced_group_sizes, interleave_buckets

BOUNDARIES = [0, 16, 32, 64, 128]
MAX_TOKENS = 256


def skewed_lengths(seed: int, n: int = 600) -> np.ndarray:
    """Mostly short samples, a handful of long ones, nothing in [32, 64): buckets of every size."""
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([
        rng.integers(1, 16, n * 2 // 3),
        rng.integers(16, 32, n - n * 2 // 3 - 5),
        rng.integers(64, 128, 3),
        rng.integers(128, MAX_TOKENS + 1, 2),  # above the last boundary: last bucket
    ])
    return rng.permutation(lengths)


def make_sampler(lengths: np.ndarray, num_replicas: int, seed: int = 0, **kwargs) -> RankAwareBucketSampler:
    return RankAwareBucketSampler(lengths, BOUNDARIES, MAX_TOKENS, num_replicas, seed, **kwargs)


def make_rank_iter(lengths: np.ndarray, num_replicas: int, seed: int, epoch: int, rank: int):
    """A rank's own sampler, as each data-parallel process holds one."""
    sampler = make_sampler(lengths, num_replicas, seed=seed)
    sampler.set_epoch(epoch)
    return sampler.rank_batches(rank)


def epoch_steps(sampler: RankAwareBucketSampler) -> list[list[list[int]]]:
    return [sampler.step_batches(step) for step in range(sampler.steps_per_epoch())]


def bucket_of_length(length: int) -> int:
    return min(max(int(np.searchsorted(BOUNDARIES, length, side="right")) - 1, 0), len(BOUNDARIES) - 1)


def padded(lengths: np.ndarray, batch: list[int]) -> int:
    return len(batch) * int(lengths[batch].max()) if batch else 0


# ---------------------------------------------------------------------------
# Coverage, budget, buckets


@pytest.mark.parametrize("num_replicas", [1, 2, 3, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_sample_once_per_epoch(num_replicas, seed):
    lengths = skewed_lengths(seed)
    sampler = make_sampler(lengths, num_replicas, seed=seed)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        by_step = [i for batches in epoch_steps(sampler) for batch in batches for i in batch]
        by_rank = [i for rank in range(num_replicas)
                   for _, batch in make_rank_iter(lengths, num_replicas, seed, epoch, rank) for i in batch]
        assert sorted(by_step) == sorted(by_rank) == list(range(len(lengths)))


@pytest.mark.parametrize("num_replicas", [1, 2, 3, 8])
def test_token_budget_and_one_bucket_per_step(num_replicas):
    lengths = skewed_lengths(3)
    sampler = make_sampler(lengths, num_replicas)
    for step, batches in enumerate(epoch_steps(sampler)):
        assert len(batches) == num_replicas
        bucket = sampler.bucket_of_step(step)
        step_samples = [i for batch in batches for i in batch]
        assert step_samples, "a step must train on something"
        assert {bucket_of_length(lengths[i]) for i in step_samples} == {bucket}
        for batch in batches:
            assert padded(lengths, batch) <= MAX_TOKENS
            # Empty batches only where the step has fewer samples than ranks.
            assert batch or len(step_samples) < num_replicas


def test_partial_step_spreads_over_all_ranks_in_budget():
    # Greedy longest-first placement would overflow here: four 16s take every rank first.
    lengths = np.array([16] * 4 + [4] * 13)
    sampler = RankAwareBucketSampler(lengths, [0], 74, num_replicas=4, seed=0, shuffle=False)
    (batches,) = epoch_steps(sampler)
    assert all(batches) and max(padded(lengths, b) for b in batches) <= 74
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))


def test_a_bucket_does_not_end_in_a_one_sample_batch_where_the_one_before_can_share():
    # in order, 3 x 10 fill a 32-token batch and the 4th is left alone; the last batch takes one
    lengths = np.array([10, 10, 10, 10])
    sampler = RankAwareBucketSampler(lengths, [0], 32, num_replicas=1, seed=0, shuffle=False)
    assert [b for (b,) in epoch_steps(sampler)] == [[0, 1], [2, 3]]
    # where two do not fit together (2 x 20 > 32), the lone sample stays alone
    lengths = np.array([10, 10, 10, 20])
    sampler = RankAwareBucketSampler(lengths, [0], 32, num_replicas=1, seed=0, shuffle=False)
    assert [b for (b,) in epoch_steps(sampler)] == [[0, 1, 2], [3]]


def test_fewer_samples_than_ranks_leaves_empty_batches():
    lengths = np.array([5, 9])
    sampler = RankAwareBucketSampler(lengths, [0], 64, num_replicas=4, seed=0)
    (batches,) = epoch_steps(sampler)
    assert sorted(len(b) for b in batches) == [0, 0, 1, 1]


def brute_force_bottleneck(lengths: list[int], num_groups: int) -> int:
    """Smallest achievable largest padded size over every assignment to num_groups ranks."""
    best = None
    for assignment in itertools.product(range(num_groups), repeat=len(lengths)):
        groups = [[l for l, a in zip(lengths, assignment) if a == g] for g in range(num_groups)]
        cost = max(len(group) * max(group, default=0) for group in groups)
        best = cost if best is None else min(best, cost)
    return best


def test_balanced_groups_reach_the_optimal_bottleneck():
    rng = np.random.default_rng(0)
    for _ in range(150):
        num_groups = int(rng.integers(2, 4))
        lengths = sorted(rng.integers(1, 20, int(rng.integers(1, 8))).tolist(), reverse=True)
        sizes = balanced_group_sizes(lengths, num_groups, max_tokens=10_000)
        assert sum(sizes) == len(lengths) and len(sizes) == min(num_groups, len(lengths))
        starts = np.cumsum([0] + sizes[:-1])
        worst = max(size * lengths[start] for start, size in zip(starts, sizes))
        assert worst == brute_force_bottleneck(lengths, num_groups)


# ---------------------------------------------------------------------------
# Interleaving


def consumed_fraction_gap(buckets: np.ndarray) -> float:
    """Largest |used_b(t) - n_b t / T| over all buckets and all t."""
    total = len(buckets)
    counts = np.bincount(buckets)
    used = np.zeros(len(counts))
    worst = 0.0
    for t, bucket in enumerate(buckets, start=1):
        used[bucket] += 1
        worst = max(worst, float(np.abs(used - counts * t / total).max()))
    return worst


@pytest.mark.parametrize("num_replicas", [1, 2, 3, 8])
def test_buckets_consumed_in_proportion(num_replicas):
    lengths = skewed_lengths(4, n=2000)
    sampler = make_sampler(lengths, num_replicas)
    buckets = np.array([sampler.bucket_of_step(s) for s in range(sampler.steps_per_epoch())])
    assert len(set(buckets.tolist())) >= 3
    assert consumed_fraction_gap(buckets) <= 1.0


def test_interleave_within_one_step_where_largest_deficit_overshoots():
    # Always taking the largest deficit reaches a gap of 1.04 on these counts and priorities.
    order = interleave_buckets([1, 1, 1, 11, 11], [4, 3, 2, 1, 0])
    assert consumed_fraction_gap(order) <= 1.0


def test_interleave_within_one_step_for_random_counts():
    rng = np.random.default_rng(5)
    for _ in range(300):
        counts = rng.integers(0, int(rng.choice([3, 30, 300])), int(rng.integers(1, 9))).tolist()
        if rng.random() < 0.3:
            counts[0] = int(rng.integers(0, 3000))
        if sum(counts) == 0:
            continue
        order = interleave_buckets(counts, rng.permutation(len(counts)).tolist())
        assert np.bincount(order, minlength=len(counts)).tolist() == counts
        assert consumed_fraction_gap(order) <= 1.0


# ---------------------------------------------------------------------------
# Determinism and resume


def test_same_seed_and_epoch_reproduce_and_epochs_differ():
    lengths = skewed_lengths(6)
    first, second = make_sampler(lengths, 3), make_sampler(lengths, 3)
    for epoch in range(3):
        first.set_epoch(epoch)
        second.set_epoch(epoch)
        assert epoch_steps(first) == epoch_steps(second)
    orders = []
    for epoch in range(3):
        first.set_epoch(epoch)
        orders.append(epoch_steps(first))
    assert orders[0] != orders[1] != orders[2] != orders[0]
    other_seed = make_sampler(lengths, 3, seed=1)
    assert epoch_steps(other_seed) != orders[2]


@pytest.mark.parametrize("num_replicas", [1, 3, 8])
def test_resume_yields_exactly_the_remaining_steps(num_replicas):
    lengths = skewed_lengths(7)
    rng = np.random.default_rng(num_replicas)
    for rank in range(num_replicas):
        for epoch in (0, 2):
            full = list(make_rank_iter(lengths, num_replicas, 0, epoch, rank))
            cut = int(rng.integers(0, len(full) + 1))
            running = make_sampler(lengths, num_replicas)
            running.set_epoch(epoch)
            taken = list(itertools.islice(running.rank_batches(rank), cut))
            resumed = make_sampler(lengths, num_replicas, seed=123)  # the checkpoint's seed wins
            resumed.load_state_dict(running.state_dict())
            resumed.set_epoch(epoch)  # a trainer calls this on resume too; it must not rewind
            assert taken + list(resumed.rank_batches(rank)) == full
            assert resumed.state_dict()["position"] == len(full)


def test_state_dict_fields():
    sampler = make_sampler(skewed_lengths(8), 2, seed=9)
    sampler.set_epoch(1)
    next(sampler.rank_batches(0))
    state = sampler.state_dict()
    assert (state["epoch"], state["position"], state["seed"]) == (1, 1, 9)
    assert state["fingerprint"]["num_replicas"] == 2


@pytest.mark.parametrize("change, named", [
    (dict(max_tokens=512), "max_tokens"),
    (dict(boundaries=[0, 16, 64, 128]), "boundaries"),
    (dict(edit_length=True), "lengths_sha256"),
])
def test_mismatched_state_raises(change, named):
    lengths = skewed_lengths(9)
    state = make_sampler(lengths, 2).state_dict()
    other = lengths.copy()
    if change.get("edit_length"):
        other[0] += 1
    sampler = RankAwareBucketSampler(other, change.get("boundaries", BOUNDARIES),
                                     change.get("max_tokens", MAX_TOKENS), change.get("num_replicas", 2), 0)
    with pytest.raises(DataError, match=named):
        sampler.load_state_dict(state)


@pytest.mark.parametrize("num_replicas", [1, 3])
@pytest.mark.parametrize("echo, span", [(2, 1), (3, 1), (2, 2), (2, 3)])
def test_echo_repeats_each_optimizer_steps_micro_batches_right_after_them(num_replicas, echo, span):
    lengths = skewed_lengths(11)
    plain = epoch_steps(make_sampler(lengths, num_replicas))
    echoed = make_sampler(lengths, num_replicas, echo=echo, echo_span=span)
    steps = epoch_steps(echoed)
    expected, marks = [], []
    for first in range(0, len(plain), span):  # a run of `span` steps, then its echoes; the last run may be short
        run = plain[first:first + span]
        expected += run * echo
        marks += [False] * len(run) + [True] * (len(run) * (echo - 1))
    assert steps == expected
    draws = [echoed.anchor_draw(step) for step in range(len(steps))]
    assert [round > 0 for _, round in draws] == marks
    # an echo draws along its first step's anchor order: that step has the same micro-batches
    assert all(steps[source] == steps[step] and (source == step) == (anchor_round == 0)
               for step, (source, anchor_round) in enumerate(draws))
    assert [draws[step][1] for step in range(len(steps)) if draws[step][0] == draws[0][0]] == list(range(echo))
    assert len(steps) == echo * len(plain)
    assert make_sampler(lengths, num_replicas).anchor_draw(5) == (5, 0)


def padded_share(lengths: np.ndarray, sampler: RankAwareBucketSampler) -> float:
    """Real tokens over padded tokens (batch size x its longest) over an epoch's micro-batches."""
    batches = [batch for step in epoch_steps(sampler) for batch in step if batch]
    return sum(int(lengths[b].sum()) for b in batches) / sum(len(b) * int(lengths[b].max()) for b in batches)


@pytest.mark.parametrize("num_replicas", [1, 3])
def test_grouping_by_length_keeps_every_sample_once_in_budget_with_far_less_padding(num_replicas):
    import dflash.data.sampler as sampler_module

    rng = np.random.default_rng(5)
    lengths = rng.integers(1, MAX_TOKENS + 1, 3000)
    wide, budget = [0, 128], 4096  # wide buckets, many samples a micro-batch: random ones pad a lot

    def make(**kwargs):
        return RankAwareBucketSampler(lengths, wide, budget, num_replicas, 0, **kwargs)

    plain, grouped = make(), make(group_by_length=True)
    for sampler in (plain, grouped):
        used = [i for step in epoch_steps(sampler) for batch in step for i in batch]
        assert sorted(used) == list(range(len(lengths)))
        assert all(padded(lengths, batch) <= budget for step in epoch_steps(sampler) for batch in step)
        assert all(len({int(lengths[i]) >= 128 for batch in step for i in batch}) <= 1
                   for step in epoch_steps(sampler))
    assert padded_share(lengths, plain) < 0.85 < 0.95 < padded_share(lengths, grouped)
    assert grouped.steps_per_epoch() < plain.steps_per_epoch()
    # the micro-batches are shuffled once cut: a chunk's longest ones do not all come first
    firsts = [int(lengths[step[0]].max()) for step in epoch_steps(grouped)[:10] if step[0]]
    assert firsts != sorted(firsts, reverse=True)
    assert sampler_module.GROUP_CHUNK < 3000, "the test needs several chunks"
    # reproducible from (seed, epoch); another epoch groups other samples together
    again = make(group_by_length=True)
    assert epoch_steps(again) == epoch_steps(grouped)
    again.set_epoch(1)
    assert epoch_steps(again) != epoch_steps(grouped)


def test_a_resume_that_changes_the_grouping_is_refused_by_name():
    lengths = skewed_lengths(14)
    with pytest.raises(DataError, match="group_by_length"):
        make_sampler(lengths, 2, group_by_length=True).load_state_dict(make_sampler(lengths, 2).state_dict())


@pytest.mark.parametrize("echo", [1, 2])
def test_a_resume_that_changes_the_echo_is_refused_by_name(echo):
    lengths = skewed_lengths(12)
    state = make_sampler(lengths, 2, echo=echo).state_dict()
    with pytest.raises(DataError, match="echo"):
        make_sampler(lengths, 2, echo=3).load_state_dict(state)


def test_a_resume_inside_an_echo_yields_exactly_the_remaining_steps():
    lengths = skewed_lengths(13)
    full = list(make_sampler(lengths, 2, echo=2, echo_span=2).rank_batches(1))
    for cut in (1, 2, 3, 5):
        running = make_sampler(lengths, 2, echo=2, echo_span=2)
        taken = list(itertools.islice(running.rank_batches(1), cut))
        resumed = make_sampler(lengths, 2, echo=2, echo_span=2)
        resumed.load_state_dict(running.state_dict())
        assert taken + list(resumed.rank_batches(1)) == full


# ---------------------------------------------------------------------------
# Progress, single rank, errors, speed


def test_progress_string():
    sampler = make_sampler(skewed_lengths(10), 2, num_epochs=3)
    sampler.set_epoch(1)
    steps = sampler.steps_per_epoch()
    assert sampler.progress() == f"epoch 2/3, 0.0% of this epoch (step 0/{steps})"
    list(itertools.islice(sampler.rank_batches(0), steps // 2))
    percent = 100 * (steps // 2) / steps
    assert sampler.progress() == f"epoch 2/3, {percent:.1f}% of this epoch (step {steps // 2}/{steps})"
    assert sampler.progress(num_epochs=6).startswith("epoch 2/6, ")
    assert make_sampler(skewed_lengths(10), 2).progress().startswith("epoch 1, 0.0% ")


def test_sample_longer_than_budget_is_a_data_error():
    with pytest.raises(DataError, match="300 tokens, more than --max-tokens=256"):
        RankAwareBucketSampler(np.array([10, 300]), BOUNDARIES, MAX_TOKENS, 2, 0)




@pytest.mark.parametrize("num_replicas", [1, 3, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_draft_position_budget_bounds_every_batch_and_keeps_every_sample(num_replicas, seed):
    """Draft positions (anchors x B, padded to the row with most) cost memory apart from the
    context tokens: with a budget, no micro-batch exceeds either, and the epoch is still whole."""
    lengths = skewed_lengths(seed)
    positions = np.minimum(lengths, 12) * 4  # min(anchors, candidates) x block size
    limit = 4 * 12 * 3  # three full-anchor rows
    sampler = make_sampler(lengths, num_replicas, seed=seed, draft_positions=positions, max_draft_positions=limit)
    steps = epoch_steps(sampler)
    seen = sorted(i for step in steps for batch in step for i in batch)
    assert seen == list(range(len(lengths)))
    widest = max(len(batch) * int(positions[batch].max()) for step in steps for batch in step if batch)
    assert widest <= limit
    assert max(padded(lengths, batch) for step in steps for batch in step) <= MAX_TOKENS
    unbounded = epoch_steps(make_sampler(lengths, num_replicas, seed=seed))
    assert len(steps) > len(unbounded), "the budget must cut the short-sample batches smaller"


def test_draft_budget_below_one_sample_names_the_flags():
    lengths = np.array([10, 20, 30])
    with pytest.raises(DataError, match="--max-draft-positions"):
        make_sampler(lengths, 1, draft_positions=lengths * 4, max_draft_positions=100)


def consume(sampler: RankAwareBucketSampler, steps: int | None = None) -> list[int]:
    """Samples of the next `steps` global steps (all ranks), as the ranks' iterators hand them out."""
    plan_steps = sampler.steps_per_epoch()
    stop = plan_steps if steps is None else min(sampler.position + steps, plan_steps)
    taken = [i for step in range(sampler.position, stop) for batch in sampler.step_batches(step) for i in batch]
    sampler.position = stop
    return taken


@pytest.mark.parametrize("counts", [(2, 1), (1, 2), (3, 8, 2), (8, 1)])
@pytest.mark.parametrize("cut", [0, 1, 7])
def test_resume_on_another_rank_count_uses_every_sample_once(counts, cut):
    """A node lost or added: the epoch continues on the new rank count over the samples not yet
    used; later epochs are whole epochs on the new count."""
    lengths = skewed_lengths(3)
    sampler = make_sampler(lengths, counts[0])
    sampler.set_epoch(1)
    seen = consume(sampler, cut)
    for replicas in counts[1:]:
        resumed = make_sampler(lengths, replicas)
        resumed.load_state_dict(sampler.state_dict())
        assert resumed.epoch == 1 and resumed.position == 0
        seen += consume(resumed, cut)
        sampler = resumed
    seen += consume(sampler)
    assert sorted(seen) == list(range(len(lengths))), "every sample of the epoch exactly once"
    assert max((padded(lengths, b) for s in range(sampler.steps_per_epoch()) for b in sampler.step_batches(s)),
               default=0) <= MAX_TOKENS
    sampler.set_epoch(2)
    assert sampler.segments == [] and sampler.steps_per_epoch() == make_sampler(lengths, counts[-1]).steps_per_epoch()


def test_resume_on_the_same_rank_count_is_unchanged_by_the_segment_logic():
    lengths = skewed_lengths(4)
    sampler = make_sampler(lengths, 2)
    sampler.set_epoch(0)
    consume(sampler, 5)
    resumed = make_sampler(lengths, 2)
    resumed.load_state_dict(sampler.state_dict())
    assert resumed.position == 5 and resumed.segments == []
    assert epoch_steps(resumed) == epoch_steps(sampler)
