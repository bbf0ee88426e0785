"""--target-forward decoder: the fast decoder's layer functions compute the features (and final
hidden state) HF's layers compute, stop at the deepest feature layer, serve length groups, and
refuse targets whose layers they would run wrongly."""

from __future__ import annotations

import pytest
import torch
import transformers

from dflash.target.frozen import FrozenTarget, TargetError
from dflash.target.layer_features import use_decoder_layers

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
FAMILIES = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}), "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
            "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v with biases
            "mistral-sliding": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 6}),
            "phi3": ("Phi3Config", "Phi3ForCausalLM", {})}


def family_target(family: str, layer_ids: list[int]) -> FrozenTarget:
    config_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**COMMON, **extra))
    return FrozenTarget(model.float().eval(), layer_ids)


def close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """float32 rounding apart: HF's RMSNorm and F.rms_norm round differently, nothing else differs."""
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5 * float(theirs.abs().max()))


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
def test_the_decoder_layers_compute_the_features_and_final_state_of_hf_layers(family):
    target = family_target(family, [0, 2])  # the deepest feature layer is not the last: the forward stops there
    ids = torch.randint(0, 97, (3, 21), generator=torch.Generator().manual_seed(1))
    hf, hf_features = target.features(ids, with_final_hidden=True), target.features(ids).features
    use_decoder_layers(target, compiled=False)
    ours = target.features(ids, with_final_hidden=True)
    close(ours.features, hf.features)
    close(ours.final_hidden, hf.final_hidden)
    stopped = target.features(ids)
    assert stopped.final_hidden is None
    torch.testing.assert_close(stopped.features, ours.features, rtol=0, atol=0)  # the same layers, stopped
    close(stopped.features, hf_features)
    # length groups (--target-length-groups) run the same forward on each group of rows
    rows = [torch.tensor([0, 2]), torch.tensor([1])]
    grouped = target.features_by_length([(ids[r, :width], r) for r, width in zip(rows, (21, 9))], tuple(ids.shape))
    torch.testing.assert_close(grouped.features[1, :9], stopped.features[1, :9], rtol=0, atol=1e-6)
    torch.testing.assert_close(grouped.features[[0, 2]], stopped.features[[0, 2]], rtol=0, atol=1e-6)


@pytest.mark.parametrize("family, why", [("mistral-sliding", "sliding-window layers"),
                                         ("phi3", "not one the fast decoder runs")])
def test_targets_the_decoder_layers_would_run_wrongly_are_refused(family, why):
    target = family_target(family, [0, 2])
    with pytest.raises(TargetError, match=f"--target-forward decoder: .*{why}.*use --target-forward hf"):
        use_decoder_layers(target, compiled=False)
    assert target.layer_forward is None


@pytest.mark.gpu
def test_on_a_gpu_the_compiled_decoder_layers_compute_hf_features_in_bfloat16():
    """Compiled for every shape: micro-batches of three shapes, each within bf16 rounding of HF's."""
    target = family_target("qwen2", [0, 2])
    target = FrozenTarget(target.model.to("cuda", torch.bfloat16), [0, 2])
    shapes = [(3, 21), (5, 40), (2, 77)]
    batches = [torch.randint(0, 97, shape, device="cuda", generator=None) for shape in shapes]
    hf = [target.features(ids).features.float() for ids in batches]
    use_decoder_layers(target, compiled=True)
    for ids, theirs in zip(batches, hf):
        ours = target.features(ids).features.float()
        assert float((ours - theirs).abs().max() / theirs.abs().max()) < 3e-2
