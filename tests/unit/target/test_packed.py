"""--target-forward packed: a micro-batch's rows packed into one sequence give HF's padded forward's
features (and final hidden state) at every real position and zeros at the padding, each row kept to
itself; targets and calls it would run wrongly are refused."""

from __future__ import annotations

import pytest
import torch
import transformers

from dflash.target.frozen import FrozenTarget, TargetError
from dflash.nn.transformer import flash_fits
from dflash.target.packed import Packing, packed_applies, packed_attention, use_packed_rows

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)


def tiny_target(family: str, dtype=torch.float64, **extra) -> FrozenTarget:
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**COMMON, **extra)
    return FrozenTarget(getattr(transformers, f"{family}ForCausalLM")(config).to(dtype).eval(), [0, 2])


def padded_batch(lengths: list[int], width: int, device="cpu") -> torch.Tensor:
    ids = torch.randint(3, 97, (len(lengths), width), generator=torch.Generator().manual_seed(1))
    ids[torch.arange(width) >= torch.tensor(lengths)[:, None]] = 0  # right padding
    return ids.to(device)


@pytest.mark.parametrize("family", ["Qwen2", "Qwen3", "Llama"])
def test_packed_rows_give_the_padded_forwards_features_at_real_positions_and_zeros_beyond(family):
    target = tiny_target(family)
    lengths = [21, 1, 9, 14]  # a full row, a one-token row
    ids = padded_batch(lengths, 21)
    padded = target.features(ids, with_final_hidden=True)
    stopped = target.features(ids)
    use_packed_rows(target)
    packed = target.features(ids, with_final_hidden=True, lengths=torch.tensor(lengths))
    packed_stopped = target.features(ids, lengths=torch.tensor(lengths))
    assert packed_stopped.final_hidden is None
    for row, length in enumerate(lengths):
        # float64: a row that saw another row's tokens, or positions not counted from its start, is far off
        torch.testing.assert_close(packed.features[row, :length], padded.features[row, :length], rtol=0, atol=1e-12)
        torch.testing.assert_close(packed.final_hidden[row, :length], padded.final_hidden[row, :length], rtol=0,
                                   atol=1e-12)
        torch.testing.assert_close(packed_stopped.features[row, :length], stopped.features[row, :length], rtol=0,
                                   atol=1e-12)
        assert not packed.features[row, length:].any()  # padding: computed by nobody
    assert target.model.config._attn_implementation == "sdpa"  # decoding's attention is back in place
    # without the lengths (evaluation, decoding's prefill) the padded forward runs as before
    torch.testing.assert_close(target.features(ids).features, stopped.features, rtol=0, atol=0)


def test_trainings_feature_computation_runs_the_target_over_the_real_tokens_only():
    """compute_features (what a training step calls) hands the rows' lengths to the packed forward:
    the embedding sees each real token once and no padding."""
    import numpy as np

    from dflash.placement.features import compute_features

    class Samples:  # what collate reads of a TokenDataset: (token ids, loss mask) by index
        rows = [np.arange(3, 3 + n) for n in (7, 2, 5)]

        def __getitem__(self, i):
            return self.rows[i], np.ones(len(self.rows[i]), dtype=bool)

    target = tiny_target("Qwen2")
    padded = compute_features(target, Samples(), [0, 1, 2], 0, with_final_hidden=False)
    use_packed_rows(target)
    seen = []
    hook = target.embed_tokens.register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    packed = compute_features(target, Samples(), [0, 1, 2], 0, with_final_hidden=False)
    hook.remove()
    assert seen == [(1, 14)]
    real = padded.loss_mask  # every token of these rows is in the loss
    torch.testing.assert_close(packed.features[real], padded.features[real], rtol=0, atol=1e-12)


def test_the_packing_places_each_rows_tokens_and_positions():
    packing = Packing.of(torch.tensor([3, 1, 2]), 4, torch.device("cpu"))
    assert packing.index.tolist() == [0, 1, 2, 4, 8, 9]
    assert packing.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert packing.starts.tolist() == packing.bounds == [0, 3, 4, 6] and packing.longest == 3
    with pytest.raises(ValueError, match=r"lengths \[3, 0\] into a batch of width 4: every row needs 1 to width"):
        Packing.of(torch.tensor([3, 0]), 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="width 2"):
        Packing.of(torch.tensor([3]), 2, torch.device("cpu"))


def test_targets_and_calls_the_packed_forward_would_run_wrongly_are_refused():
    with pytest.raises(TargetError,
                       match="--target-forward packed: it has sliding-window layers.*use --target-forward hf"):
        use_packed_rows(tiny_target("Mistral", sliding_window=6))
    q = torch.zeros(1, 4, 5, 16)
    with pytest.raises(TargetError, match="reached attention without its row bounds.*use --target-forward hf"):
        packed_attention(torch.nn.Identity(), q, q[:, :2], q[:, :2], None)


def test_auto_packs_the_rows_unless_the_target_has_sliding_windows_or_the_rows_are_grouped():
    qwen = tiny_target("Qwen2")
    assert packed_applies(qwen, 1) is None
    assert packed_applies(qwen, 4) == "--target-length-groups 4 computes the target by groups of rows"
    assert "sliding-window layers" in packed_applies(tiny_target("Mistral", sliding_window=6), 1)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["Qwen2", "Qwen3"])
def test_on_a_gpu_packed_rows_through_flash_attention_match_the_padded_forward(family):
    """bf16 on a GPU: FlashAttention's variable-length kernel over the packed rows (the path training
    takes) gives the padded forward's features to bf16 rounding."""
    target = tiny_target(family, dtype=torch.bfloat16)
    target.model.cuda()
    lengths = [37, 5, 64, 20]
    ids = padded_batch(lengths, 64, "cuda")
    padded = target.features(ids, with_final_hidden=True)
    use_packed_rows(target)
    assert flash_fits(torch.device("cuda"), torch.bfloat16, 16)
    packed = target.features(ids, with_final_hidden=True, lengths=torch.tensor(lengths))
    for row, length in enumerate(lengths):
        scale = float(padded.features[row, :length].float().abs().max())
        torch.testing.assert_close(packed.features[row, :length].float(), padded.features[row, :length].float(),
                                   rtol=2e-2, atol=2e-2 * scale)
        torch.testing.assert_close(packed.final_hidden[row, :length].float(),
                                   padded.final_hidden[row, :length].float(), rtol=2e-2, atol=5e-2)
        assert not packed.features[row, length:].any()
