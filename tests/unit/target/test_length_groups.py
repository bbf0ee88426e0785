"""The target's forward in groups of rows of about one length: the plan pads the fewest positions,
and the features it gives are the one-forward features at every real position."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from conftest import tiny_causal_lm, write_chat_jsonl
from dflash.data.dataset import TokenDataset
from dflash.data.prepare import prepare_dataset
from dflash.placement.features import LocalFeatures, compute_features
from dflash.target import length_groups
from dflash.target.frozen import FrozenTarget
from dflash.target.length_groups import MIN_SAVING, computed_positions, plan_length_groups
from tiny_tokenizer import make_tiny_tokenizer


def partitions(items):
    """Every way to split `items` into non-empty sets."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for smaller in partitions(rest):
        for k in range(len(smaller)):
            yield smaller[:k] + [[first] + smaller[k]] + smaller[k + 1:]
        yield [[first]] + smaller


def runs(order: list[int]):
    """Every way to cut `order` into consecutive runs."""
    for cuts in itertools.product([False, True], repeat=len(order) - 1):
        parts, current = [], [order[0]]
        for item, cut in zip(order[1:], cuts):
            if cut:
                parts.append(current)
                current = []
            current.append(item)
        yield parts + [current]


def cost(partition, lengths) -> int:
    return sum(len(s) * int(lengths[s].max()) for s in partition)


@pytest.mark.parametrize("seed", range(12))
def test_the_plan_pads_within_the_saving_margin_of_the_best_split_of_the_sorted_rows(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 100, size=int(rng.integers(2, 8)))
    max_groups, min_tokens = int(rng.integers(1, 4)), int(rng.choice([0, 60, 150]))
    whole = len(lengths) * int(lengths.max())
    order = np.argsort(-lengths, kind="stable").tolist()
    allowed = [p for p in runs(order) if len(p) == 1 or (len(p) <= max_groups and all(
        len(s) * lengths[s].max() >= min_tokens for s in p))]
    best = min(cost(p, lengths) for p in allowed)
    groups = plan_length_groups(lengths, max_groups, min_tokens)
    assert sorted(np.concatenate([g.rows for g in groups]).tolist()) == list(range(len(lengths)))
    assert all(g.width == lengths[g.rows].max() for g in groups)
    assert len(groups) <= max_groups
    assert len(groups) == 1 or all(len(g.rows) * g.width >= min_tokens for g in groups)
    assert best <= computed_positions(groups) <= best + MIN_SAVING * whole
    if len(groups) > 1:  # no fewer groups would have done as well
        fewer = [p for p in allowed if len(p) < len(groups)]
        assert min(cost(p, lengths) for p in fewer) > best + MIN_SAVING * whole
    if min_tokens == 0:  # why runs of the sorted rows suffice: no other split of the rows pads fewer
        anyhow = [p for p in partitions(list(range(len(lengths)))) if len(p) <= max_groups]
        assert min(cost(p, lengths) for p in anyhow) == best


def test_one_group_where_a_split_saves_nothing_or_is_not_asked_for():
    assert len(plan_length_groups([50] * 40, 4, 0)) == 1
    mixed = [10] * 20 + [500] * 20
    assert len(plan_length_groups(mixed, 1, 0)) == 1
    two = plan_length_groups(mixed, 4, 0)
    assert [sorted(g.rows.tolist()) for g in two] == [list(range(20, 40)), list(range(20))]
    assert len(plan_length_groups(mixed, 4, 10_001)) == 1  # each group would pad fewer positions than that
    with pytest.raises(ValueError, match="max_groups 0"):
        plan_length_groups(mixed, 0)


def test_thousands_of_rows_plan_over_evenly_spaced_places():
    lengths = np.random.default_rng(0).integers(10, 770, size=3000)
    groups = plan_length_groups(lengths, 4, 4096)
    assert sorted(np.concatenate([g.rows for g in groups]).tolist()) == list(range(3000))
    assert len(groups) == 4 and computed_positions(groups) < 0.7 * 3000 * lengths.max()


def grouped_and_whole(tmp_path, monkeypatch, with_final: bool):
    monkeypatch.setattr(length_groups, "MIN_GROUP_TOKENS", 0)  # tiny batches split too
    tokenizer = make_tiny_tokenizer()
    dataset = TokenDataset(prepare_dataset(write_chat_jsonl(tmp_path / "chats.jsonl", 12, 3), tokenizer,
                                           tmp_path / "shard", max_length=256))
    target = FrozenTarget(tiny_causal_lm("qwen3", vocab_size=len(tokenizer) + 3).double(), [1, 3, 5])
    indices = list(range(12))
    assert len(set(dataset.lengths[indices].tolist())) > 3, "the rows need lengths of their own"
    calls = []
    original = target.features_by_length
    monkeypatch.setattr(target, "features_by_length", lambda *a, **k: calls.append(len(a[0])) or original(*a, **k))
    grouped = compute_features(target, dataset, indices, 0, with_final_hidden=with_final, length_groups=3)
    whole = compute_features(target, dataset, indices, 0, with_final_hidden=with_final)
    assert calls and calls[0] > 1, "the grouped forward ran in groups"
    return dataset, indices, grouped, whole


@pytest.mark.parametrize("with_final", [False, True])
def test_grouped_features_equal_one_forwards_at_every_real_position(tmp_path, monkeypatch, with_final):
    dataset, indices, grouped, whole = grouped_and_whole(tmp_path, monkeypatch, with_final)
    assert grouped.features.shape == whole.features.shape
    assert torch.equal(grouped.input_ids, whole.input_ids) and torch.equal(grouped.loss_mask, whole.loss_mask)
    lengths = dataset.lengths[indices]
    width = {int(row): g.width for g in plan_length_groups(lengths, 3) for row in g.rows}
    assert min(width.values()) < lengths.max()
    for row, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(grouped.features[row, :n], whole.features[row, :n], rtol=0, atol=1e-12)
        assert not grouped.features[row, width[row]:].any(), "positions past a row's group width are zeros"
        if with_final:
            torch.testing.assert_close(grouped.final_hidden[row, :n], whole.final_hidden[row, :n], rtol=0, atol=1e-12)
        else:
            assert grouped.final_hidden is None


def test_a_colocated_rank_runs_its_target_in_the_groups_it_is_given(tmp_path, monkeypatch):
    monkeypatch.setattr(length_groups, "MIN_GROUP_TOKENS", 0)
    tokenizer = make_tiny_tokenizer()
    dataset = TokenDataset(prepare_dataset(write_chat_jsonl(tmp_path / "chats.jsonl", 12, 3), tokenizer,
                                           tmp_path / "shard", max_length=256))
    target = FrozenTarget(tiny_causal_lm("qwen3", vocab_size=len(tokenizer) + 3).double(), [1, 3])
    widths = []
    original = target.features_by_length
    monkeypatch.setattr(target, "features_by_length",
                        lambda parts, *a, **k: widths.append([ids.shape[1] for ids, _ in parts]) or original(parts, *a, **k))
    source = LocalFeatures(target, dataset, 0, False, length_groups=2)
    batches = list(source.batches(iter([(0, list(range(12))), (1, [3])])))
    assert len(batches) == 2 and len(widths) == 1 and len(widths[0]) == 2  # one row alone never splits
    assert widths[0][0] == int(dataset.lengths.max()) > widths[0][1]


@pytest.mark.gpu
def test_grouped_features_on_a_gpu_match_one_forward_in_bfloat16(tmp_path, monkeypatch):
    monkeypatch.setattr(length_groups, "MIN_GROUP_TOKENS", 0)
    from conftest import tiny_target

    target = tiny_target("qwen3", dtype=torch.bfloat16)
    target.model.cuda()
    lengths = [200, 190, 120, 40, 35, 8]
    ids = torch.randint(0, target.model.config.vocab_size, (len(lengths), max(lengths)))
    plan = plan_length_groups(lengths, 3)
    assert len(plan) > 1
    parts = [(ids[torch.from_numpy(g.rows), :g.width].cuda(), torch.from_numpy(g.rows).cuda()) for g in plan]
    grouped = target.features_by_length(parts, tuple(ids.shape)).features
    whole = target.features(ids.cuda()).features
    width = {int(row): g.width for g in plan for row in g.rows}
    assert min(width.values()) < max(lengths)
    for row, n in enumerate(lengths):
        torch.testing.assert_close(grouped[row, :n], whole[row, :n], rtol=2e-2, atol=2e-2)
        assert not grouped[row, width[row]:].any(), "positions past a row's group width are zeros"
