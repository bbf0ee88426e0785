"""--init-from-target-layers: drafter layers start as copies of the named target layers."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_causal_lm, tiny_drafter, tiny_target
from dflash.drafter.init_from_target import init_from_target_layers
from dflash.target.frozen import TargetError


def saved_target(tmp_path, arch: str):
    model = tiny_causal_lm(arch)
    model.save_pretrained(tmp_path / arch)
    return model, str(tmp_path / arch)


def test_layers_and_final_norm_are_the_named_target_layers(tmp_path, arch):
    model, folder = saved_target(tmp_path, arch)
    drafter = tiny_drafter(tiny_target(arch), num_layers=2).float()
    fc_before = drafter.fc.weight.clone()
    kept = init_from_target_layers(drafter, folder, [5, 3])
    for i, t in enumerate([5, 3]):
        ours, theirs = drafter.layers[i], model.model.layers[t]
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"):
            assert torch.equal(ours.get_submodule(name).weight, theirs.get_submodule(name).weight), (i, name)
    assert torch.equal(drafter.norm.weight, model.model.norm.weight)
    assert torch.equal(drafter.fc.weight, fc_before)  # the feature fusion is the drafter's own
    assert "fc.weight" in kept and "hidden_norm.weight" in kept
    # Llama layers have no q/k norms: the drafter keeps its own (ones); Qwen3 layers bring theirs.
    assert ("layers.0.self_attn.q_norm.weight" in kept) == (arch == "llama")


def test_wrong_count_or_layer_is_refused(tmp_path):
    _, folder = saved_target(tmp_path, "qwen3")
    drafter = tiny_drafter(tiny_target("qwen3"), num_layers=2)
    with pytest.raises(ValueError, match="one target layer per drafter layer"):
        init_from_target_layers(drafter, folder, [5])
    with pytest.raises(ValueError, match=r"outside the target's layers 0..5"):
        init_from_target_layers(drafter, folder, [5, 6])


def test_a_target_without_decoder_layers_is_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"embed.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    drafter = tiny_drafter(tiny_target("qwen3"), num_layers=2)
    with pytest.raises(TargetError, match="Llama/Qwen-style decoder"):
        init_from_target_layers(drafter, str(tmp_path), [0, 1])
