"""The FLOP model behind placement: it reproduces DESIGN.md's table for a Qwen3-8B-shaped target,
and `auto` splits only where a split keeps nearly colocated's work per GPU."""

from __future__ import annotations

import numpy as np
import pytest

from dflash.drafter.flops import CostShapes, drafter_flops, target_flops
from dflash.placement.topology import split_efficiency, suggest_target_ranks

QWEN3_8B = CostShapes(hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128, vocab=151936,
                      target_layers_run=34, drafter_layers=5, num_features=5, anchors=512, block_size=16)


@pytest.mark.parametrize("length, ratio", [(770, 0.15), (1728, 0.34), (3072, 0.59), (8192, 1.53)])
def test_target_to_drafter_ratio_matches_the_design_table(length, ratio):
    assert target_flops(QWEN3_8B, length) / drafter_flops(QWEN3_8B, length) == pytest.approx(ratio, rel=0.05)


def test_split_efficiency_is_one_only_at_the_balanced_split():
    assert split_efficiency(0.25, 8, 2) == pytest.approx(1.0)
    assert split_efficiency(0.25, 8, 1) == pytest.approx(0.5)  # the lone target sets the pace
    assert split_efficiency(0.25, 8, 4) == pytest.approx(2 / 3)  # the drafters do


def test_auto_keeps_two_gpus_colocated_and_splits_eight_for_chat_lengths():
    lengths = np.random.default_rng(0).integers(600, 2900, size=600)  # target share about 0.24
    two, report = suggest_target_ranks(QWEN3_8B, lengths, 2)
    assert two == "colocated" and "suggested colocated" in report
    eight, report = suggest_target_ranks(QWEN3_8B, lengths, 8)
    assert eight == 2, report
    assert suggest_target_ranks(QWEN3_8B, lengths, 1)[0] == "colocated"
