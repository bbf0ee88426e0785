"""Training's target forward through the fast decoder's layer functions (dflash.target.static):
q/k/v and gate/up as one matrix product each, its RoPE, causal attention over right-padded rows
(no cache, no mask), stopped after the deepest feature layer. On a GPU the layer functions run
compiled once for every micro-batch shape, so a layer's elementwise work (norms, RoPE, SiLU,
residuals) fuses into a few kernels where HF's layers run their RoPE eagerly on strided views.

`--target-forward decoder` turns it on (FrozenTarget.layer_forward); Llama, Mistral, Qwen2 and
Qwen3 targets without sliding-window layers.
"""

from __future__ import annotations

import functools

import torch

from dflash.nn.transformer import rms_norm
from dflash.target.frozen import FrozenTarget, TargetError
from dflash.target.static import (dynamic_layer_parts, fast_decoding_supported, finish_layer, fused_rows, layer_windows,
                                  project_qkv, rope_tables)
from dflash.util.runtime import allow_compiled_variants


def layer_forward_problem(target: FrozenTarget) -> str | None:
    """Why the decoder's layer functions cannot compute this target's features, or None."""
    config = target.model.config
    if not fast_decoding_supported(target):
        return f"its family ({getattr(config, 'model_type', type(target.model).__name__)}) is not one the fast decoder runs"
    if any(layer_windows(config, len(target.layers))):
        return "it has sliding-window layers, whose window a plain causal attention would not keep"
    return None


def use_decoder_layers(target: FrozenTarget, compiled: bool) -> None:
    """FrozenTarget.features (and features_by_length) of `target` run through decoder_layer_features
    from now on; `compiled`: the layer functions compiled for dynamic shapes (a GPU)."""
    problem = layer_forward_problem(target)
    if problem is not None:
        raise TargetError(f"--target-forward decoder: {problem}; use --target-forward hf")
    if compiled:
        allow_compiled_variants()  # the first layer (no residual to add) and the rest; gradients never on
    target.layer_forward = functools.partial(decoder_layer_features, target, compiled=compiled)


@torch.no_grad()
def decoder_layer_features(target: FrozenTarget, input_ids: torch.Tensor, with_final_hidden: bool,
                           compiled: bool = False) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
    """FrozenTarget.layer_outputs's result for right-padded `input_ids` [b, S]: the feature layers'
    outputs by layer id, and the final normed hidden state when asked (then every layer runs)."""
    layers, wanted = target.layers, set(target.layer_ids)
    project, finish = dynamic_layer_parts() if compiled else (project_qkv, finish_layer)
    hkv = target.model.config.num_key_value_heads
    x, delta = target.embed_tokens(input_ids), None  # the residual stream is x + delta (finish_layer)
    b, s = input_ids.shape
    cos, sin = rope_tables(target, x, torch.arange(s, device=input_ids.device)[None].expand(b, -1))
    last = len(layers) - 1 if with_final_hidden else max(wanted)
    captured: dict[int, torch.Tensor] = {}
    for index in range(last + 1):
        layer = layers[index]
        attention, mlp = layer.self_attn, layer.mlp
        qkv = fused_rows(attention, "dflash_qkv", [attention.q_proj, attention.k_proj, attention.v_proj])
        gate_up = fused_rows(mlp, "dflash_gate_up", [mlp.gate_proj, mlp.up_proj])
        q, k, v, x = project(layer, qkv, x, delta, cos, sin, hkv)
        if index - 1 in wanted:  # x: the previous layer's output
            captured[index - 1] = x
        x, delta = finish(layer, gate_up, x, q, k, v, None, hkv)
    x = x + delta
    if last in wanted:
        captured[last] = x
    return captured, rms_norm(target.decoder.norm, x) if with_final_hidden else None
