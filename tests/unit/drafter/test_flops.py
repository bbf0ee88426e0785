"""The FLOP model: the target's count against torch's own FLOP counter on a real HF forward, and
the drafter's count built from its parts (linear in anchors, lm_head forward + input gradient)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash.drafter.flops import CostShapes, drafter_flops, micro_batch_flops, target_flops

SHAPES = CostShapes(hidden=128, intermediate=384, heads=4, kv_heads=2, head_dim=32, vocab=1000,
                    target_layers_run=3, drafter_layers=2, num_features=3, anchors=64, block_size=8)


def test_target_count_matches_torch_flop_counter_on_a_real_forward():
    config = Qwen3Config(vocab_size=SHAPES.vocab, hidden_size=SHAPES.hidden, intermediate_size=SHAPES.intermediate,
                         num_hidden_layers=SHAPES.target_layers_run, num_attention_heads=SHAPES.heads,
                         num_key_value_heads=SHAPES.kv_heads, head_dim=SHAPES.head_dim,
                         attn_implementation="eager")  # attention as plain matmuls
    model = Qwen3ForCausalLM(config).eval()
    length = 96
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.model(input_ids=torch.randint(0, SHAPES.vocab, (1, length)), use_cache=False)
    # eager attention computes all S x S scores and values, masked; the model counts the causal half
    attention = 2 * 2 * SHAPES.heads * SHAPES.head_dim * length * length * SHAPES.target_layers_run
    assert counter.get_total_flops() == pytest.approx(target_flops(SHAPES, length) + attention / 2, rel=1e-6)


def test_drafter_count_is_linear_in_anchors_and_carries_the_lm_head():
    length, mean_anchor = 400, 200.0
    one, two = (drafter_flops(SHAPES, length, anchors=a, mean_anchor=mean_anchor) for a in (10, 20))
    zero = drafter_flops(SHAPES, length, anchors=0, mean_anchor=mean_anchor)  # context-only work
    assert two - one == pytest.approx(one - zero)
    lm_head_per_anchor = 2 * 2 * SHAPES.hidden * SHAPES.vocab * (SHAPES.block_size - 1)
    bigger_vocab = CostShapes(**{**SHAPES.__dict__, "vocab": 2 * SHAPES.vocab})
    grown = drafter_flops(bigger_vocab, length, anchors=10, mean_anchor=mean_anchor) - one
    assert grown == pytest.approx(10 * lm_head_per_anchor)
    # anchors default to as many as the length allows, capped by the shapes' maximum
    assert drafter_flops(SHAPES, 30) == drafter_flops(SHAPES, 30, anchors=29)
    assert drafter_flops(SHAPES, 400) == drafter_flops(SHAPES, 400, anchors=64)


def test_micro_batch_is_the_sum_of_its_sequences():
    lengths, anchors = [100, 250], [40, 64]
    drafter = drafter_flops(SHAPES, 100, 40) + drafter_flops(SHAPES, 250, 64)
    assert micro_batch_flops(SHAPES, lengths, anchors, with_target=False) == pytest.approx(drafter)
    target = target_flops(SHAPES, 100) + target_flops(SHAPES, 250)
    assert micro_batch_flops(SHAPES, lengths, anchors, with_target=True) == pytest.approx(drafter + target)


def test_a_sliding_window_caps_the_context_each_query_attends_to():
    windowed = CostShapes(**{**SHAPES.__dict__, "window": 50})
    short, long_ = (drafter_flops(s, 400, anchors=10, mean_anchor=200.0) for s in (windowed, SHAPES))
    per_context_position = 3 * SHAPES.drafter_layers * 2 * 2 * SHAPES.heads * SHAPES.head_dim * 10 * SHAPES.block_size
    assert long_ - short == pytest.approx(per_context_position * (200 - 50))
    assert drafter_flops(windowed, 400, 10, mean_anchor=30.0) == drafter_flops(SHAPES, 400, 10, mean_anchor=30.0)
