"""Start the drafter's layers from copies of target layers instead of random weights.

The drafter's layers have the target's width, heads and MLP size (dflash.drafter.model), so a
Llama/Qwen-style target layer fits one drafter layer name for name. Its weights carry what the
target learned about the language, which a drafter trained on a few million tokens cannot learn
from scratch. What a target layer lacks keeps its initial value: Llama layers have no q/k norms,
so those stay at 1 (they then only rescale each head's queries and keys); `fc` and `hidden_norm`
(the feature fusion) are the drafter's own. The final norm is copied from the target's too.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash.drafter.model import DFlashDrafter
from dflash.target.frozen import TargetError, read_safetensors, safetensors_names

# drafter parameter (inside `layers.N.`) -> the target layer's parameter (inside its `layers.M.`)
LAYER_PARAMETERS = [
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
]
REQUIRED = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}


def _target_prefix(names: set[str]) -> str:
    """`model.` for a causal LM saved whole, `model.language_model.` and the like for wrappers."""
    for name in sorted(names):
        if name.endswith("layers.0.self_attn.q_proj.weight"):
            return name[: -len("layers.0.self_attn.q_proj.weight")]
    raise TargetError("no `layers.0.self_attn.q_proj.weight` among the target's weights: "
                      "--init-from-target-layers needs a Llama/Qwen-style decoder")


@torch.no_grad()
def init_from_target_layers(drafter: DFlashDrafter, target_path: str, layer_ids: list[int]) -> list[str]:
    """Copy target layer `layer_ids[i]` into drafter layer i (and the target's final norm into
    the drafter's). Returns the drafter parameters that kept their initial value."""
    if len(layer_ids) != len(drafter.layers):
        raise ValueError(f"--init-from-target-layers {layer_ids}: give one target layer per drafter layer "
                         f"({len(drafter.layers)}, --num-draft-layers)")
    num_target_layers = drafter.config.num_target_layers
    bad = [i for i in layer_ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(f"--init-from-target-layers {layer_ids}: {bad} outside the target's layers "
                         f"0..{num_target_layers - 1}")
    folder = Path(target_path)
    names = safetensors_names(folder)
    prefix = _target_prefix(names)
    wanted = {f"{prefix}layers.{t}.{p}": f"layers.{i}.{p}" for i, t in enumerate(layer_ids) for p in LAYER_PARAMETERS}
    wanted[f"{prefix}norm.weight"] = "norm.weight"
    tensors = read_safetensors(folder, set(wanted) & names)
    own = dict(drafter.named_parameters())
    copied = set()
    for source, tensor in tensors.items():
        name = wanted[source]
        if own[name].shape != tensor.shape:
            raise TargetError(f"--init-from-target-layers: target {source} is {tuple(tensor.shape)}, drafter {name} "
                              f"is {tuple(own[name].shape)}")
        own[name].copy_(tensor.to(own[name].dtype))
        copied.add(name)
    missing = [f"layers.{i}.{p}" for i in range(len(layer_ids)) for p in REQUIRED if f"layers.{i}.{p}" not in copied]
    if missing:
        raise TargetError(f"--init-from-target-layers: the target has no weights for {missing[:3]}...; "
                          "it needs a Llama/Qwen-style decoder")
    return sorted(set(own) - copied)
