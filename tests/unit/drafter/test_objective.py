"""Loss weights, EAL, anchor sampling bounds, the normalised loss, export round trip, and a
short optimisation that must lower the loss and raise accuracy."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import MASK_ID, tiny_drafter, tiny_target
from dflash.drafter.attention import BlockLayout
from dflash.drafter.export import export_drafter, load_drafter
from dflash.drafter.objective import (Blocks, anchor_candidates, build_blocks, default_gamma, dflash_loss,
                                      expected_acceptance_length, sample_anchors, slot_weights)
from dflash.drafter.step import DrafterStep, StepSettings
from dflash.target.frozen import default_target_layer_ids


def test_slot_weights_follow_the_recipe():
    w = slot_weights(16, 7.0)
    assert w[0] == 0
    for j in range(1, 16):
        assert math.isclose(float(w[j]), math.exp(-(j - 1) / 7.0), rel_tol=1e-6)
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)


def test_expected_acceptance_length_formula():
    acc = torch.tensor([0.0, 0.9, 0.5, 0.2], dtype=torch.float64)  # slot 0 is ignored
    assert math.isclose(expected_acceptance_length(acc), 0.9 + 0.9 * 0.5 + 0.9 * 0.5 * 0.2, rel_tol=1e-9)
    assert expected_acceptance_length(torch.tensor([0.0, 1.0, 1.0, 1.0])) == 3.0


def test_default_target_layers():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [17]  # one feature: the middle of the span, as in the reference
    assert default_target_layer_ids(8, 5) == [1, 2, 3, 4, 5]
    assert len(set(default_target_layer_ids(4, 4))) == 4


def test_anchor_sampling_bounds_and_reproducibility():
    loss_mask = torch.zeros(3, 50, dtype=torch.bool)
    loss_mask[0, 10:30] = True  # 19 candidates (a and a+1 in the response)
    loss_mask[1, 5:8] = True
    loss_mask[1, 20:22] = True  # 2 + 1 candidates
    loss_mask[2, 49] = True  # a+1 would be past the end: no candidate
    candidates = anchor_candidates(loss_mask)
    assert candidates.sum(1).tolist() == [19, 3, 0]
    for max_anchors in (1, 5, 100):
        layout = sample_anchors(loss_mask, max_anchors, 4, torch.Generator().manual_seed(0))
        for row in range(3):
            chosen = layout.anchors[row][layout.valid[row]]
            assert len(chosen) == min(max_anchors, int(candidates[row].sum()))
            assert len(set(chosen.tolist())) == len(chosen), "without replacement"
            assert candidates[row, chosen].all(), "only where the mask holds at a and a+1"
            assert chosen.tolist() == sorted(chosen.tolist())
    first = sample_anchors(loss_mask, 5, 4, torch.Generator().manual_seed(1))
    again = sample_anchors(loss_mask, 5, 4, torch.Generator().manual_seed(1))
    other = sample_anchors(loss_mask, 5, 4, torch.Generator().manual_seed(2))
    assert torch.equal(first.anchors, again.anchors)
    assert not torch.equal(first.anchors, other.anchors), "a new epoch seed re-samples"
    for max_anchors in (1, 5, 100):  # a count the host knows gives the layout the read-back gives
        host = max(min(19, max_anchors), min(3, max_anchors), 1)
        read_back = sample_anchors(loss_mask, max_anchors, 4, torch.Generator().manual_seed(4))
        told = sample_anchors(loss_mask, max_anchors, 4, torch.Generator().manual_seed(4), count=host)
        assert told.anchors.shape == (3, host)
        assert torch.equal(told.anchors, read_back.anchors) and torch.equal(told.valid, read_back.valid)
    with pytest.raises(ValueError, match="told 4 anchors for the widest row, which takes 5"):
        sample_anchors(loss_mask, 5, 4, torch.Generator().manual_seed(4), count=4)


def test_an_echo_round_takes_the_next_anchors_along_the_same_random_order():
    loss_mask = torch.zeros(3, 50, dtype=torch.bool)
    loss_mask[0, 10:30] = True  # 19 candidates
    loss_mask[1, 5:8] = True  # 2 candidates: fewer than a round
    loss_mask[2, 0:45] = True  # 44 candidates

    def chosen(echo_round):
        layout = sample_anchors(loss_mask, 8, 4, torch.Generator().manual_seed(3), echo_round=echo_round)
        return [set(layout.anchors[row][layout.valid[row]].tolist()) for row in range(3)]

    rounds = [chosen(k) for k in range(3)]
    default = sample_anchors(loss_mask, 8, 4, torch.Generator().manual_seed(3))
    assert rounds[0] == [set(default.anchors[row][default.valid[row]].tolist()) for row in range(3)]
    candidates = anchor_candidates(loss_mask)
    for row, count in enumerate(candidates.sum(1).tolist()):
        sizes = [len(r[row]) for r in rounds]
        assert sizes == [min(8, count)] * 3
    # 19 candidates: rounds 0 and 1 are disjoint, round 2 holds the 3 left and wraps to round 0's first 5
    assert not rounds[0][0] & rounds[1][0]
    assert rounds[0][0] | rounds[1][0] | rounds[2][0] == set(candidates[0].nonzero()[:, 0].tolist())
    assert len(rounds[2][0] & rounds[0][0]) == 5
    assert rounds[0][1] == rounds[1][1] == rounds[2][1]  # every candidate in every round
    assert not (rounds[0][2] & rounds[1][2]) and not (rounds[1][2] & rounds[2][2]) and not (rounds[0][2] & rounds[2][2])


def test_loss_is_the_weight_normalised_cross_entropy():
    torch.manual_seed(0)
    b, s, bs, d, v = 1, 12, 4, 8, 11
    ids = torch.randint(0, v, (b, s))
    loss_mask = torch.zeros(b, s, dtype=torch.bool)
    loss_mask[:, 3:10] = True
    layout = BlockLayout(torch.tensor([[3, 7]]), torch.tensor([[True, True]]), s, bs)
    blocks = build_blocks(ids, loss_mask, layout, v - 1)
    hidden = torch.randn(b, 2 * bs, d)
    head = torch.nn.Linear(d, v, bias=False)
    w = slot_weights(bs, 2.0)
    out = dflash_loss(hidden, blocks, head, w, chunk_size=3)
    num = den = 0.0
    for q in range(2 * bs):
        if blocks.label_mask[0, q]:
            wq = float(w[q % bs])
            ce = torch.nn.functional.cross_entropy(head(hidden[0, q])[None], blocks.labels[0, q][None])
            num += wq * float(ce.detach())
            den += wq
    assert math.isclose(float(out.loss.detach()), num / den, rel_tol=1e-5)
    assert out.slot_count.tolist() == [0, 2, 2, 1]  # block at 7: slots 8, 9 in the mask; 10 is not


def random_blocks(b: int, s: int, bs: int, v: int, prompt: int, anchors: int) -> Blocks:
    """Blocks over random ids whose response starts at `prompt`, anchors drawn with seed 0."""
    torch.manual_seed(0)
    ids = torch.randint(0, v, (b, s))
    loss_mask = torch.zeros(b, s, dtype=torch.bool)
    loss_mask[:, prompt:] = True
    return build_blocks(ids, loss_mask, sample_anchors(loss_mask, anchors, bs, torch.Generator().manual_seed(0)), v - 1)


@pytest.mark.parametrize("distill", [False, True])
@pytest.mark.parametrize("chunk", [3, 4096])
def test_fused_loss_matches_autograd_loss_and_gradients(chunk, distill):
    """The fused lm_head + CE (+ KL to the target's distribution; gradients taken in the forward
    pass) against plain autograd."""
    b, s, bs, d, v = 2, 40, 4, 16, 37
    blocks = random_blocks(b, s, bs, v, prompt=5, anchors=6)
    head = torch.nn.Linear(d, v, bias=False).requires_grad_(False)
    w = slot_weights(bs, 2.0)
    teacher = torch.randn(b, s, d, generator=torch.Generator().manual_seed(2)) if distill else None
    results = []
    for fused in (True, False):
        hidden = torch.randn(b, blocks.input_ids.shape[1], d, generator=torch.Generator().manual_seed(1))
        hidden.requires_grad_(True)
        out = dflash_loss(hidden, blocks, head, w, chunk_size=chunk, fused=fused, teacher_hidden=teacher,
                          kl_weight=0.7 if distill else 0.0)
        (out.loss * 3.0).backward()  # a non-unit upstream gradient must scale the fused one
        results.append((out, hidden.grad))
    (fused_out, fused_grad), (plain_out, plain_grad) = results
    assert torch.allclose(fused_out.loss, plain_out.loss, rtol=1e-5, atol=1e-6)
    assert torch.allclose(fused_grad, plain_grad, rtol=1e-4, atol=1e-7)
    assert float(fused_grad.abs().sum()) > 0
    assert torch.equal(fused_out.slot_correct, plain_out.slot_correct)
    assert torch.equal(fused_out.block_streaks, plain_out.block_streaks)
    assert torch.allclose(fused_out.kl, plain_out.kl, rtol=1e-5, atol=1e-7)
    assert (float(fused_out.kl) > 0.01) == distill


@pytest.mark.parametrize("fused", [True, False])
def test_the_loss_counts_the_distinct_tokens_drafted_at_the_scored_slots(fused):
    """What a collapsed drafter shows (one token drafted everywhere): distinct argmax rows at the
    scored slots, counted on the device; a head whose rows favour one token gives 1."""
    b, s, bs, d, v = 2, 40, 4, 16, 37
    blocks = random_blocks(b, s, bs, v, prompt=5, anchors=6)
    head = torch.nn.Linear(d, v, bias=False).requires_grad_(False)
    hidden = torch.randn(b, blocks.input_ids.shape[1], d, generator=torch.Generator().manual_seed(1))
    out = dflash_loss(hidden, blocks, head, slot_weights(bs, 2.0), chunk_size=5, fused=fused)
    drafted = head(hidden[blocks.label_mask]).argmax(-1)
    assert float(out.distinct_predictions) == len(drafted.unique()) > 3
    with torch.no_grad():
        head.weight[7] = 100 * hidden[blocks.label_mask].mean(0)  # every scored row's argmax is row 7
    hidden = hidden[blocks.label_mask].mean(0).expand_as(hidden) + 0.01 * hidden
    assert float(dflash_loss(hidden, blocks, head, slot_weights(bs, 2.0), fused=fused).distinct_predictions) == 1


@pytest.mark.parametrize("distill", [False, True])
def test_fused_loss_keeps_no_vocabulary_sized_tensor_for_backward(distill):
    """What autograd saves is [rows, D] at most: [rows, V] logits (V = 152K for Qwen3) would not
    fit at --max-tokens 32768, with distillation as without."""
    b, s, bs, d, v = 2, 40, 4, 16, 997
    blocks = random_blocks(b, s, bs, v, prompt=5, anchors=6)
    head = torch.nn.Linear(d, v, bias=False).requires_grad_(False)
    teacher = torch.randn(b, s, d) if distill else None
    hidden = torch.randn(b, blocks.input_ids.shape[1], d, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        out = dflash_loss(hidden, blocks, head, slot_weights(bs, 2.0), teacher_hidden=teacher,
                          kl_weight=1.0 if distill else 0.0)
    out.loss.backward()
    assert saved and all(v not in shape for shape in saved)
    assert float(hidden.grad.abs().sum()) > 0


def test_export_round_trip(tmp_path):
    target = tiny_target("qwen3", dtype=torch.float32)
    drafter = tiny_drafter(target, block_size=8, num_layers=2).float()
    folder = export_drafter(drafter, tmp_path / "drafter", dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == 8 and config["num_target_layers"] == 6
    assert config["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": target.layer_ids, "block_size": 8}
    # vLLM takes this key as is and otherwise adds 1 to target_layer_ids: an off-by-one here
    # loads without error and silently collapses acceptance
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in target.layer_ids]
    assert config["num_hidden_layers"] == 2 and len(config["layer_types"]) == 2
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight",
            "layers.0.mlp.gate_proj.weight", "layers.0.post_attention_layernorm.weight"} <= names
    assert not any("embed" in n or "lm_head" in n or n.startswith("model.") for n in names)
    loaded = load_drafter(folder)
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert loaded.config.dflash_config == drafter.config.dflash_config


def test_short_run_lowers_loss_and_raises_accuracy():
    """A tiny target that repeats a short cycle is easy to draft: 60 steps must learn it."""
    target = tiny_target("qwen3", dtype=torch.float32)
    drafter = tiny_drafter(target, block_size=4).float()
    settings = StepSettings(max_anchors=16, slot_weights=slot_weights(4, 4.0), attention_backend="sdpa")
    step = DrafterStep(drafter, target.embed_tokens, target.lm_head, settings)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    cycle = torch.tensor([3, 14, 15, 92, 65, 35, 89, 79])
    ids = torch.stack([cycle.roll(k).repeat(5) for k in range(4)])  # [4, 40]
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    loss_mask[:, :8] = False
    features = target.features(ids).features
    history = []
    for i in range(60):
        blocks = step.sample_blocks(ids, loss_mask, torch.Generator().manual_seed(i))
        out = step.loss(blocks, features)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        history.append((float(out.loss.detach()), float(out.slot_correct[1:].sum() / out.slot_count[1:].sum())))
    assert history[-1][0] < 0.75 * history[0][0]
    assert history[-1][1] > history[0][1] + 0.5


def test_distillation_uses_the_target_distribution_of_the_previous_position():
    """Slot j predicts x[a+j]; the target's distribution for that token sits at row a+j-1."""
    torch.manual_seed(0)
    s, bs, d, v = 10, 4, 8, 13
    ids = torch.randint(0, v, (1, s))
    loss_mask = torch.ones(1, s, dtype=torch.bool)
    layout = BlockLayout(torch.tensor([[2, 5]]), torch.tensor([[True, True]]), s, bs)
    blocks = build_blocks(ids, loss_mask, layout, v - 1)
    head = torch.nn.Linear(d, v, bias=False)
    teacher = torch.randn(1, s, d)
    hidden = teacher[0, (blocks.positions[0] - 1).clamp(min=0)][None]  # drafter == teacher
    w = slot_weights(bs, 2.0)
    matched = dflash_loss(hidden, blocks, head, w, teacher_hidden=teacher, kl_weight=1.0)
    assert float(matched.kl) < 1e-6
    shifted = teacher[0, blocks.positions[0].clamp(max=s - 1)][None]  # off by one position
    off = dflash_loss(shifted, blocks, head, w, teacher_hidden=teacher, kl_weight=1.0)
    assert float(off.kl) > 0.01
    assert math.isclose(float(off.loss.detach()), float(off.ce + off.kl), rel_tol=1e-5)


def test_dpace_weights_by_hand():
    """Two blocks of B=4 (slot 0 is the anchor, never scored); in the second, slot 2 is unscored.
    alpha 0.5: q~ = 0.5 q + 0.5, w_j = sum over scored m >= j of prod_{i <= m} q~_i."""
    from dflash.drafter.objective import dpace_weights

    q = torch.tensor([[1.0, 0.8, 0.5, 0.2, 1.0, 0.8, 0.3, 0.2]])
    scored = torch.tensor([[False, True, True, True, False, True, False, True]])
    weights = dpace_weights(-q.log(), scored, 4, alpha=0.5)
    # block 1: q~ = .9, .75, .6 -> prefix .9, .675, .405 -> w = 1.98, 1.08, .405
    # block 2: q~ = .9, (1, unscored), .6 -> prefix .9, .9, .54 -> w = .9 + .54, 0, .54
    want = torch.tensor([[0.0, 1.98, 1.08, 0.405, 0.0, 1.44, 0.0, 0.54]])
    assert torch.allclose(weights, want, atol=1e-6)
    assert not weights.requires_grad


@pytest.mark.parametrize("fused", [True, False])
def test_dpace_loss_is_its_weighted_mean_and_the_weights_carry_no_gradient(fused):
    from dflash.drafter.objective import LossTerms, dpace_weights

    b, s, bs, d, v = 2, 30, 4, 16, 37
    blocks = random_blocks(b, s, bs, v, prompt=4, anchors=5)
    head = torch.nn.Linear(d, v, bias=False).requires_grad_(False)
    hidden = torch.randn(b, blocks.input_ids.shape[1], d, requires_grad=True)
    out = dflash_loss(hidden, blocks, head, slot_weights(bs, 2.0), fused=fused, terms=LossTerms("dpace", 0.5))
    out.loss.backward()
    # reference: per-slot CE by plain autograd, D-PACE weights as constants
    ref_hidden = hidden.detach().clone().requires_grad_(True)
    ce = torch.nn.functional.cross_entropy(head(ref_hidden).flatten(0, 1), blocks.labels.flatten(),
                                           reduction="none").view(b, -1)
    w = dpace_weights(ce.detach(), blocks.label_mask, bs, 0.5)
    ref = (ce * w).sum() / blocks.label_mask.sum()  # per scored slot
    ref.backward()
    assert torch.allclose(out.loss, ref, rtol=1e-5)
    assert torch.allclose(hidden.grad, ref_hidden.grad, rtol=1e-4, atol=1e-7)
    both = dflash_loss(hidden, blocks, head, slot_weights(bs, 2.0), fused=fused, terms=LossTerms("ce+dpace", 0.5, 0.3))
    assert torch.allclose(both.loss, both.ce + 0.3 * ref, rtol=1e-5)


def test_stride_anchors_are_a_block_apart_and_uniform_weights_are_flat():
    loss_mask = torch.zeros(2, 40, dtype=torch.bool)
    loss_mask[0, 5:] = True
    loss_mask[1, 11:30] = True
    layout = sample_anchors(loss_mask, 100, 4, torch.Generator().manual_seed(0), stride=True)
    assert layout.anchors[0][layout.valid[0]].tolist() == list(range(5, 39, 4))
    assert layout.anchors[1][layout.valid[1]].tolist() == list(range(11, 29, 4))
    assert slot_weights(4, None).tolist() == [0.0, 1.0, 1.0, 1.0]


def test_zeroed_features_control_ignores_the_features():
    from dflash.drafter.step import DrafterStep, StepSettings

    target = tiny_target()
    drafter = tiny_drafter(target)
    settings = StepSettings(max_anchors=8, slot_weights=slot_weights(4, 4.0), attention_backend="sdpa",
                            zero_features=True)
    step = DrafterStep(drafter, target.embed_tokens, target.lm_head, settings)
    ids = torch.randint(0, 50, (2, 24))
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    blocks = step.sample_blocks(ids, loss_mask, torch.Generator().manual_seed(0))
    features = target.features(ids).features
    one = step.loss(blocks, features).loss
    assert torch.equal(one, step.loss(blocks, torch.randn_like(features)).loss)
    settings.zero_features = False
    assert not torch.equal(one, step.loss(blocks, features).loss)


@pytest.mark.parametrize("fused", [True, False])
def test_a_micro_batch_with_no_scored_slot_still_backpropagates(fused):
    """Rows whose responses are too short for any anchor: the loss is 0, and backward still
    reaches the drafter (the engine needs a gradient on every rank)."""
    b, s, bs, d, v = 2, 12, 4, 8, 11
    loss_mask = torch.zeros(b, s, dtype=torch.bool)
    loss_mask[:, -1] = True  # one response token: no position a with a + 1 in the response
    blocks = build_blocks(torch.randint(0, v, (b, s)), loss_mask,
                          sample_anchors(loss_mask, 4, bs, torch.Generator().manual_seed(0)), v - 1)
    assert not blocks.label_mask.any()
    hidden = torch.randn(b, blocks.input_ids.shape[1], d, requires_grad=True)
    out = dflash_loss(hidden, blocks, torch.nn.Linear(d, v, bias=False), slot_weights(bs, 2.0), fused=fused)
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and torch.equal(hidden.grad, torch.zeros_like(hidden))


def test_a_block_never_scores_past_the_end_of_its_reply():
    """--loss-turns all puts two replies in the loss, with a short user turn between them: a
    block anchored near the first reply's end scores only the rest of that reply, never the
    second reply past the user turn (slot j counts only when a..a+j are all in the loss mask)."""
    from dflash.data.tokenization import load_tokenizer, tokenize_conversation
    from dflash.demo import DEMO_TARGET_DIR

    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue is one."},
                {"role": "user", "content": "ok"}, {"role": "assistant", "content": "Red is another."}]
    ids, mask = tokenize_conversation(load_tokenizer(DEMO_TARGET_DIR), messages, loss_turns="all")
    edges = [i for i in range(1, len(mask) + 1) if i == len(mask) or mask[i] != mask[i - 1]]
    replies = [(start, end) for start, end in zip([0] + edges, edges) if mask[start]]
    assert len(replies) == 2 and replies[1][0] - replies[0][1] < 16, "two replies, a short gap between"
    ids, mask = torch.from_numpy(ids).long()[None], torch.from_numpy(mask)[None]
    block = 16  # longer than what is left of the first reply from its late anchors, and than the gap
    anchors = anchor_candidates(mask)[0].nonzero().flatten()
    layout = BlockLayout(anchors[None], torch.ones(1, len(anchors), dtype=torch.bool), ids.shape[1], block)
    blocks = build_blocks(ids, mask, layout, MASK_ID)
    scored = blocks.label_mask.view(len(anchors), block)
    for a, row in zip(anchors.tolist(), scored):
        reply_end = next(end for start, end in replies if start <= a < end)
        expected = torch.zeros(block, dtype=torch.bool)
        expected[1:min(block, reply_end - a)] = True  # every slot up to the end of the anchor's reply
        assert torch.equal(row, expected), f"the block anchored at {a} (reply ends at {reply_end})"
