"""The DFlash invariants that public trainers have broken: look-ahead, leakage, labels,
train/inference agreement. Everything runs in float64 so equality checks are tight."""

from __future__ import annotations

import pytest
import torch

from conftest import MASK_ID, tiny_drafter, tiny_target
from dflash.drafter.attention import BlockLayout, dense_block_mask
from dflash.drafter.model import DrafterCache
from dflash.drafter.objective import build_blocks, slot_weights
from dflash.drafter.step import DrafterStep, StepSettings

BLOCK = 4
ANCHORS = [12, 20, 27]
SEQ = 40


def make_step(arch: str = "qwen3", window: int = 0):
    target = tiny_target(arch)
    drafter = tiny_drafter(target, block_size=BLOCK, window=window)
    settings = StepSettings(max_anchors=8, slot_weights=slot_weights(BLOCK, 4.0), attention_backend="sdpa")
    return target, DrafterStep(drafter, target.embed_tokens, target.lm_head, settings)


def sequence(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MASK_ID, (1, SEQ), generator=g)
    loss_mask = torch.zeros(1, SEQ, dtype=torch.bool)
    loss_mask[:, 10:] = True
    return ids, loss_mask


def fixed_layout(anchors=ANCHORS) -> BlockLayout:
    return BlockLayout(
        anchors=torch.tensor([anchors]), valid=torch.ones(1, len(anchors), dtype=torch.bool),
        context_len=SEQ, block_size=BLOCK,
    )


def block_logits(step: DrafterStep, ids, loss_mask, features) -> torch.Tensor:
    """Logits [N, B, V] of every block at the fixed anchors."""
    blocks = step.make_blocks(ids, loss_mask, fixed_layout())
    hidden = step.hidden(blocks, features)
    return step.lm_head(hidden).view(len(ANCHORS), BLOCK, -1)


def test_no_look_ahead_through_tokens_or_features(arch):
    target, step = make_step(arch)
    ids, loss_mask = sequence()
    base = block_logits(step, ids, loss_mask, target.features(ids).features)
    n, anchor = 1, ANCHORS[1]

    later = ids.clone()
    later[:, anchor + 1:] = (later[:, anchor + 1:] + 7) % MASK_ID  # tokens after the anchor
    changed = block_logits(step, later, loss_mask, target.features(later).features)
    torch.testing.assert_close(changed[n], base[n], rtol=0, atol=1e-12)

    features = target.features(ids).features
    poked = features.clone()
    poked[:, anchor:] += 5.0  # features AT and after the anchor (a `<=` mask would see them)
    changed = block_logits(step, ids, loss_mask, poked)
    torch.testing.assert_close(changed[n], base[n], rtol=0, atol=1e-12)
    assert not torch.allclose(changed[n + 1], base[n + 1]), "a later block must see position a_n"

    poked = features.clone()
    poked[:, anchor - 1] += 5.0  # the last context position a block may see
    changed = block_logits(step, ids, loss_mask, poked)
    assert (changed[n] - base[n]).abs().max() > 1e-3
    torch.testing.assert_close(changed[0], base[0], rtol=0, atol=1e-12)  # anchor 12 < 19


def test_no_leakage_between_blocks():
    target, step = make_step()
    ids, loss_mask = sequence()
    features = target.features(ids).features
    blocks = step.make_blocks(ids, loss_mask, fixed_layout())
    base = step.lm_head(step.hidden(blocks, features)).view(len(ANCHORS), BLOCK, -1)
    for n in range(len(ANCHORS)):
        poked_ids = blocks.input_ids.clone().view(len(ANCHORS), BLOCK)
        poked_ids[n] = (poked_ids[n] + 3) % MASK_ID  # every slot of block n, anchor included
        poked = build_blocks(ids, loss_mask, fixed_layout(), MASK_ID)
        poked.input_ids = poked_ids.view(1, -1)
        out = step.lm_head(step.hidden(poked, features)).view(len(ANCHORS), BLOCK, -1)
        for other in range(len(ANCHORS)):
            if other == n:
                assert (out[other] - base[other]).abs().max() > 1e-3
            else:
                torch.testing.assert_close(out[other], base[other], rtol=0, atol=1e-12)


def test_slots_see_each_other_both_ways_inside_a_block():
    """Bidirectional inside the block: an early slot's output depends on a later slot's input
    (a causal block mask, a bug seen in public trainers, would leave it untouched)."""
    target, step = make_step()
    ids, loss_mask = sequence()
    features = target.features(ids).features
    blocks = step.make_blocks(ids, loss_mask, fixed_layout())
    base = step.lm_head(step.hidden(blocks, features)).view(len(ANCHORS), BLOCK, -1)
    embeds = target.embed_tokens(blocks.input_ids)
    poked = embeds.clone().view(1, len(ANCHORS), BLOCK, -1)
    poked[0, 1, BLOCK - 1] += 1.0  # the last slot's input of block 1
    context_positions = torch.arange(SEQ)[None]
    mask = dense_block_mask(blocks.layout)
    hidden = step.forward(poked.view(1, -1, embeds.shape[-1]), blocks.positions, features, context_positions, mask)
    out = step.lm_head(hidden).view(len(ANCHORS), BLOCK, -1)
    assert (out[1, 1] - base[1, 1]).abs().max() > 1e-3, "slot 1 must see slot B-1 of its block"
    torch.testing.assert_close(out[0], base[0], rtol=0, atol=1e-12)


def test_labels_are_the_next_tokens_of_the_response_only():
    ids, loss_mask = sequence()
    layout = fixed_layout([9, 20, 38])  # 9: slot 0 is prompt; 38: slots run past the end
    blocks = build_blocks(ids, loss_mask, layout, MASK_ID)
    labels = blocks.labels.view(3, BLOCK)
    scored = blocks.label_mask.view(3, BLOCK)
    inputs = blocks.input_ids.view(3, BLOCK)
    positions = blocks.positions.view(3, BLOCK)
    for n, anchor in enumerate(layout.anchors[0].tolist()):
        assert inputs[n, 0] == ids[0, anchor] and (inputs[n, 1:] == MASK_ID).all()
        assert positions[n].tolist() == [anchor + j for j in range(BLOCK)]
        assert not scored[n, 0], "slot 0 is the given anchor token: never scored"
        for j in range(1, BLOCK):
            pos = anchor + j
            expect = pos < SEQ and bool(loss_mask[0, anchor:pos + 1].all())  # a..a+j in the response
            assert bool(scored[n, j]) == expect
            if expect:
                assert labels[n, j] == ids[0, pos]
    assert not scored[0].any()  # anchored on the prompt: outside the loss mask (sampling never anchors there)
    assert scored[2].tolist() == [False, True, False, False]


def test_dense_mask_pattern():
    layout = BlockLayout(anchors=torch.tensor([[3, 6]]), valid=torch.tensor([[True, True]]),
                         context_len=8, block_size=2)
    mask = dense_block_mask(layout)[0, 0]
    expected = torch.zeros(4, 12, dtype=torch.bool)
    expected[0:2, 0:3] = True  # block 0 sees context 0..2
    expected[2:4, 0:6] = True  # block 1 sees context 0..5
    expected[0:2, 8:10] = True
    expected[2:4, 10:12] = True
    assert torch.equal(mask, expected)


def test_windowed_mask_pattern():
    layout = BlockLayout(anchors=torch.tensor([[3, 6]]), valid=torch.tensor([[True, True]]),
                         context_len=8, block_size=2, window=2)
    mask = dense_block_mask(layout)[0, 0]
    expected = torch.zeros(4, 12, dtype=torch.bool)
    expected[0:2, 1:3] = True  # block 0 (anchor 3) sees context 1..2
    expected[2:4, 4:6] = True  # block 1 (anchor 6) sees context 4..5
    expected[0:2, 8:10] = True
    expected[2:4, 10:12] = True
    assert torch.equal(mask, expected)


def test_a_windowed_block_ignores_features_before_its_window():
    window = 5
    target, step = make_step("qwen3", window=window)
    ids, loss_mask = sequence()
    features = target.features(ids).features
    base = block_logits(step, ids, loss_mask, features)
    anchor = ANCHORS[1]
    for pos, inside in ((anchor - window - 1, False), (anchor - window, True)):
        changed = features.clone()
        changed[:, pos] += 1.0
        moved = (block_logits(step, ids, loss_mask, changed)[1] - base[1]).abs().max()
        assert (moved > 1e-6) == inside, (pos, float(moved))


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("chunks, stacked", [([20], False), ([7, 13], False), ([7, 13], True)],
                         ids=["one-piece", "two-pieces", "two-pieces-stacked"])
def test_training_forward_equals_cached_inference(arch, chunks, window, stacked):
    """Decoding's cached forward (with the projections it stacks, as a decoder runs it, or not)
    gives the training forward's logits."""
    from dflash.drafter.model import StackedProjections

    target, step = make_step(arch, window=window)
    stacked = StackedProjections.of(step.drafter) if stacked else None
    ids, loss_mask = sequence()
    features = target.features(ids).features
    logits = block_logits(step, ids, loss_mask, features)
    n, anchor = 1, ANCHORS[1]
    cache = DrafterCache.allocate(step.drafter.config, 1, 32, features.device, features.dtype)
    start = 0
    for size in chunks:  # the context arrives in pieces during decoding
        positions = torch.arange(start, start + size)[None]
        step.drafter.extend_context(cache, features[:, start:start + size], positions, stacked)
        start += size
    assert start == anchor
    # columns past the anchor hold a rejected draft's features: the block must not see them
    step.drafter.extend_context(cache, features[:, :BLOCK] * 7 + 1, torch.arange(anchor, anchor + BLOCK)[None], stacked)
    block_ids = torch.full((1, BLOCK), MASK_ID)
    block_ids[0, 0] = ids[0, anchor]
    hidden = step.drafter.draft(cache, target.embed_tokens(block_ids), torch.arange(anchor, anchor + BLOCK)[None], stacked)
    torch.testing.assert_close(step.lm_head(hidden)[0], logits[n], rtol=1e-9, atol=1e-9)


def test_a_target_with_rope_per_layer_type_gives_the_drafter_its_full_attention_rope():
    """Gemma 3 nests rope_parameters by layer type; drafter layers are full attention."""
    from transformers import Gemma3TextConfig

    from dflash.drafter.model import DFlashDrafter, drafter_config

    target = Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config = drafter_config(target, 1, [1, 3], 4, 96)
    assert config.rope_parameters["rope_theta"] == target.rope_parameters["full_attention"]["rope_theta"]
    drafter = DFlashDrafter(config)
    assert sum(p.numel() for p in drafter.parameters()) > 0


def test_padding_blocks_for_flex_change_neither_loss_nor_gradients():
    """Flex attention pads a micro-batch with few anchors up to its query-row floor (below it the
    compiled kernel has no backward). The padding must leave the loss, every gradient and the
    metrics as they were; float64 so that only a real difference shows."""
    from dflash.drafter.attention import FLEX_MIN_QUERY_ROWS, pad_blocks

    target, step = make_step()
    step.drafter.double()
    ids, loss_mask = sequence()
    features = target.features(ids).features.double()
    layout = fixed_layout()
    padded = pad_blocks(layout, FLEX_MIN_QUERY_ROWS)
    assert padded.anchors.shape[1] * BLOCK >= FLEX_MIN_QUERY_ROWS > layout.anchors.shape[1] * BLOCK
    assert not padded.valid[:, len(ANCHORS):].any()
    assert pad_blocks(padded, FLEX_MIN_QUERY_ROWS) is padded

    def loss_and_grads(layout):
        step.drafter.zero_grad()
        out = step.loss(step.make_blocks(ids, loss_mask, layout), features)
        out.loss.backward()
        return out, {name: p.grad.clone() for name, p in step.drafter.named_parameters() if p.grad is not None}

    plain, plain_grads = loss_and_grads(layout)
    pad, pad_grads = loss_and_grads(padded)
    torch.testing.assert_close(pad.loss, plain.loss, rtol=1e-12, atol=1e-12)
    assert plain_grads.keys() == pad_grads.keys() and plain_grads
    for name, grad in plain_grads.items():
        torch.testing.assert_close(pad_grads[name], grad, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    assert torch.equal(pad.slot_count, plain.slot_count) and torch.equal(pad.block_streaks, plain.block_streaks)


def test_the_flex_backend_pads_blocks_to_its_query_row_floor():
    from dflash.drafter.attention import FLEX_MIN_QUERY_ROWS

    _, step = make_step()
    ids, loss_mask = sequence()
    step.settings.attention_backend = "flex"
    blocks = step.make_blocks(ids, loss_mask, fixed_layout())
    assert blocks.input_ids.shape[1] >= FLEX_MIN_QUERY_ROWS
    assert not blocks.label_mask[:, len(ANCHORS) * BLOCK:].any()
    step.settings.attention_backend = "sdpa"
    assert step.make_blocks(ids, loss_mask, fixed_layout()).input_ids.shape[1] == len(ANCHORS) * BLOCK
