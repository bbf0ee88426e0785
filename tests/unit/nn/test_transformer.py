"""The transformer pieces the drafter and the fast decoder share compute what HF's Qwen3 / Llama
modeling files compute: RMSNorm as Qwen3RMSNorm (and its gradients as the formula's), RoPE as
apply_rotary_pos_emb (from HF's own tables and from ours, scaled RoPE included), and grouped-query
attention as HF's eager attention with repeat_kv, under boolean and additive masks, with the
query heads as they are and as rows of their key/value head (the decoding layout)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import (Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb,
                                                      eager_attention_forward)

from conftest import flash_varlen_stand_in
from dflash.nn.transformer import LiveColumns, RMSNorm, RotaryAngles, attend, rms_norm, rotate, signed_sin

TIGHT = dict(rtol=1e-12, atol=1e-12)


def test_rmsnorm_computes_the_formula_and_its_gradients_and_hf_rmsnorm_in_float32():
    """In float64 the output and every gradient equal the RMSNorm formula's (HF's Qwen3RMSNorm
    rounds through float32 even there); in float32 it agrees with HF's Qwen3 and Llama norms."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=torch.float64, generator=g)
    weight = torch.randn(16, dtype=torch.float64, generator=g)

    def formula(inputs, w):
        return inputs * torch.rsqrt(inputs.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def output_and_gradients(run):
        inputs, w = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = run(inputs, w)
        (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        return out.detach(), inputs.grad, w.grad

    def fused(inputs, w):
        return torch.func.functional_call(RMSNorm(16, eps=1e-6).double(), {"weight": w}, (inputs,))

    for got, expected in zip(output_and_gradients(fused), output_and_gradients(formula)):
        torch.testing.assert_close(got, expected, **TIGHT)
    for hf in (Qwen3RMSNorm(16, eps=1e-6), LlamaRMSNorm(16, eps=1e-6)):
        hf.weight.data.copy_(weight.float())
        torch.testing.assert_close(rms_norm(hf, x.float()), hf(x.float()), rtol=1e-6, atol=1e-6)
    ours = RMSNorm(16, eps=1e-6)
    ours.weight.data.copy_(weight.float())
    torch.testing.assert_close(ours(x.float()), Qwen3RMSNorm.forward(ours, x.float()), rtol=1e-6, atol=1e-6)


ROPES = {"default": {"rope_type": "default", "rope_theta": 10000.0},
         "yarn": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32}}


@pytest.mark.parametrize("rope", ROPES)
def test_rotary_embedding_equals_hf_apply_rotary_pos_emb(rope):
    """Both ways the tables reach `rotate`: HF's rotary module's with the signs folded in (the
    fast decoder) and RotaryAngles' own (the drafter); yarn scales cos and sin by its factor."""
    config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=128, rope_parameters=ROPES[rope])
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 7, 16, dtype=torch.float64, generator=g)
    k = torch.randn(2, 2, 7, 16, dtype=torch.float64, generator=g)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [3, 9, 40, 41, 42, 100, 127]])
    cos, sin = Qwen3RotaryEmbedding(config)(q, positions)
    expected = apply_rotary_pos_emb(q, k, cos, sin)
    ours = RotaryAngles(config)(positions, torch.float64)
    assert ours[0].shape == (2, 1, 7, 16)
    assert (RotaryAngles(config).scaling != 1) == (rope == "yarn"), "yarn scales the tables"
    for tables in ((cos[:, None], signed_sin(sin)[:, None]), ours):
        for x, hf in zip((q, k), expected):
            torch.testing.assert_close(rotate(x, *tables), hf, **TIGHT)


SOFTMAX_FP32 = dict(rtol=1e-6, atol=1e-6)  # HF's eager attention takes its softmax in float32 even for float64


def hf_attention(q, k, v, additive, scale):
    """HF's eager attention (repeat_kv, float32 softmax), back in [b, H, T, d]."""
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], training=False)
    return eager_attention_forward(module, q, k, v, additive, scale)[0].transpose(1, 2)


@pytest.mark.parametrize("scale", [None, 0.3])
def test_grouped_query_attention_equals_hf_eager_attention_with_repeat_kv(scale):
    b, hq, hkv, t, s, d = 2, 6, 2, 5, 9, 8
    group = hq // hkv
    g = torch.Generator().manual_seed(2)
    q = torch.randn(b, hq, t, d, dtype=torch.float64, generator=g)
    k, v = (torch.randn(b, hkv, s, d, dtype=torch.float64, generator=g) for _ in range(2))
    sees = torch.rand(b, 1, t, s, generator=g) < 0.6
    sees[..., 0] = True  # no row without a visible key
    additive = torch.zeros(sees.shape, dtype=torch.float64).masked_fill_(~sees, float("-inf"))
    hf_scale = d ** -0.5 if scale is None else scale
    expected = hf_attention(q, k, v, additive, hf_scale)

    torch.testing.assert_close(attend(q, k, v, sees, scale), expected, **SOFTMAX_FP32)
    torch.testing.assert_close(attend(q, k, v, additive, scale), expected, **SOFTMAX_FP32)
    torch.testing.assert_close(attend(q, k, v, None, scale), hf_attention(q, k, v, None, hf_scale), **SOFTMAX_FP32)
    rows = q.reshape(b, hkv, group * t, d)  # decoding: the heads of one key/value head as its rows
    by_rows = attend(rows, k, v, additive.repeat(1, 1, group, 1), scale).reshape(b, hq, t, d)
    torch.testing.assert_close(by_rows, expected, **SOFTMAX_FP32)


def test_rows_reading_only_their_live_columns_attend_as_under_the_span_mask(monkeypatch):
    """LiveColumns hands the kernel the caches as strided views (sequence b from row b x Hkv x
    capacity): each row's query heads see its first lengths[b] columns, as the additive mask does,
    for one layer's caches inside a bigger buffer of fewer rows than it was made with."""
    import dflash.nn.transformer as transformer

    monkeypatch.setattr(transformer, "flash_varlen", flash_varlen_stand_in)
    layers, made_rows, b, hkv, group, capacity, d = 3, 5, 4, 2, 3, 32, 8
    g = torch.Generator().manual_seed(3)
    shape = (layers, made_rows, hkv, capacity, d)
    keys, values = (torch.randn(shape, dtype=torch.float64, generator=g) for _ in range(2))
    k, v = keys[:, :b][1], values[:, :b][1]  # as StaticTarget.keep_rows leaves them
    q = torch.randn(b, hkv, group, d, dtype=torch.float64, generator=g)
    lengths = torch.tensor([5, capacity, 1, 17], dtype=torch.int32)
    sees = torch.arange(capacity)[None] < lengths[:, None]
    additive = torch.zeros(b, 1, group, capacity, dtype=torch.float64).masked_fill_(~sees[:, None, None], float("-inf"))
    live = attend(q, k, v, LiveColumns(lengths), 0.3)
    torch.testing.assert_close(live, attend(q, k, v, additive, 0.3), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="laid out"):
        attend(q, k[:, :, :16], v[:, :, :16], LiveColumns(lengths), 0.3)  # a span slice is not the whole cache
