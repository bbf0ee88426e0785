"""The draft vocabulary: which tokens it keeps, that a drafter with one trains on exactly the
loss of the target's lm_head cut to those rows, that it drafts only them and decoding stays the
target's greedy output, and that export and load keep its ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import MASK_ID, tiny_drafter, tiny_target
from dflash.drafter.attention import BlockLayout
from dflash.drafter.export import export_drafter, load_drafter
from dflash.drafter.model import DFlashDrafter, drafter_config
from dflash.drafter.objective import build_blocks, slot_weights
from dflash.drafter.step import DrafterStep, StepSettings
from dflash.drafter.vocab import DraftHead, choose_draft_vocabulary, coverage
from dflash.eval.speculative import Decoder

BLOCK = 4


def test_the_vocabulary_keeps_the_most_frequent_tokens_and_the_end_of_sequence():
    counts = np.array([5, 0, 9, 5, 1, 7, 0, 2])
    assert choose_draft_vocabulary(counts, 3).tolist() == [0, 2, 5]  # 9, 7, then the lower id of the 5s
    assert choose_draft_vocabulary(counts, 3, always=[6]).tolist() == [2, 5, 6]
    assert coverage(counts, choose_draft_vocabulary(counts, 3)) == pytest.approx(21 / 29)
    with pytest.raises(ValueError, match="a draft vocabulary of 9 tokens from a vocabulary of 8"):
        choose_draft_vocabulary(counts, 9)


def vocab_drafter(target, ids: list[int]) -> DFlashDrafter:
    torch.manual_seed(1)
    config = drafter_config(target.model.config, 2, target.layer_ids, BLOCK, MASK_ID, draft_vocab=len(ids))
    drafter = DFlashDrafter(config).to(target.embed_tokens.weight.dtype)
    drafter.draft_to_target.copy_(torch.tensor(ids))
    return drafter


def test_training_loss_and_gradients_are_those_of_the_lm_head_cut_to_the_vocabulary():
    """The reference: the same drafter without a vocabulary, scoring with an lm_head that holds only
    the vocabulary's rows, on labels renumbered by hand and with the labels outside it unscored."""
    target = tiny_target()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MASK_ID, (2, 40), generator=g)
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:, 8:] = True
    vocab = sorted(torch.randperm(MASK_ID, generator=g)[:60].tolist())
    layout = BlockLayout(torch.tensor([[9, 17, 25], [12, 20, 30]]), torch.ones(2, 3, dtype=torch.bool), 40, BLOCK)
    settings = StepSettings(max_anchors=8, slot_weights=slot_weights(BLOCK, 4.0), attention_backend="sdpa",
                            fused_loss=False)
    features = target.features(ids).features

    with_vocab = vocab_drafter(target, vocab)
    step = DrafterStep(with_vocab, target.embed_tokens, target.lm_head, settings)
    blocks = step.make_blocks(ids, loss_mask, layout)
    out = step.loss(blocks, features)
    out.loss.backward()

    plain = tiny_drafter(target, block_size=BLOCK, num_layers=2)
    cut = torch.nn.Linear(64, len(vocab), bias=False, dtype=torch.float64)
    cut.weight.data.copy_(target.lm_head.weight[vocab])
    reference = DrafterStep(plain, target.embed_tokens, cut, settings)
    ref_blocks = reference.make_blocks(ids, loss_mask, layout)
    row = {token: i for i, token in enumerate(vocab)}
    inside = torch.tensor([[t in row for t in r] for r in ref_blocks.labels.tolist()])
    ref_blocks.label_mask &= inside
    ref_blocks.labels = torch.tensor([[row.get(t, 0) for t in r] for r in ref_blocks.labels.tolist()])
    ref_blocks.labels[~ref_blocks.label_mask] = 0
    ref = reference.loss(ref_blocks, features)
    ref.loss.backward()

    left_out = int((blocks.label_mask != build_blocks(ids, loss_mask, layout, MASK_ID).label_mask).sum())
    assert left_out > 0, "some labels must fall outside the vocabulary for this to test anything"
    assert torch.equal(blocks.label_mask, ref_blocks.label_mask) and torch.equal(blocks.labels, ref_blocks.labels)
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-12)
    for (name, p), q in zip(with_vocab.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_a_drafter_with_a_vocabulary_drafts_only_its_tokens_and_decoding_stays_greedy(monkeypatch):
    target = tiny_target(dtype=torch.float32)
    vocab = list(range(0, MASK_ID, 2))  # the even ids: the target's greedy replies hold odd ones too
    drafter = vocab_drafter(target, vocab).eval()
    head = DraftHead.of(drafter, target.lm_head)
    hidden = torch.randn(5, 64)
    assert torch.equal(head.to_target(head(hidden).argmax(-1)),
                       torch.tensor(vocab)[(hidden @ target.lm_head.weight[vocab].T).argmax(-1)])
    drafted = []
    to_target = DraftHead.to_target
    monkeypatch.setattr(DraftHead, "to_target", lambda self, rows: drafted.append(to_target(self, rows)) or drafted[-1])
    decoder = Decoder(target, drafter, 96, "auto")
    for prompt in ([5, 9, 13, 7, 21, 3], [11, 4, 8, 30, 2, 6, 17]):
        greedy = decoder.greedy(prompt, 24, set())
        assert any(t % 2 for t in greedy.tokens), "the reply must hold tokens the drafter cannot draft"
        assert decoder.speculative(prompt, 24, set()).tokens == greedy.tokens
    drafts = torch.cat(drafted).tolist()
    assert len(drafts) >= 2 * (BLOCK - 1) and set(drafts) <= set(vocab), drafts


def test_export_and_load_keep_the_vocabularys_ids(tmp_path):
    """Ids past 256, which bfloat16 (the exported weights' dtype) would round."""
    target = tiny_target(dtype=torch.float32)
    config = drafter_config(target.model.config, 1, target.layer_ids, BLOCK, MASK_ID, draft_vocab=3)
    config.vocab_size = 5000
    drafter = DFlashDrafter(config)
    drafter.draft_to_target.copy_(torch.tensor([7, 1001, 4999]))
    loaded = load_drafter(export_drafter(drafter, tmp_path / "d"))
    assert loaded.draft_to_target.dtype == torch.long and loaded.draft_to_target.tolist() == [7, 1001, 4999]
    assert loaded.config.dflash_config["draft_vocab_size"] == 3
