"""Rotary position embedding, RMSNorm and grouped-query attention: the Llama / Qwen3 modeling
files' computations (apply_rotary_pos_emb, Qwen3RMSNorm, eager attention with repeat_kv) in one
or two calls each, because a decode step is bound by its kernel count. tests/unit/nn/ holds them
to HF's numbers; the drafter's layers and the target's fast decoder both run them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An HF RMSNorm module's computation (its `weight` and `variance_epsilon`) in one fused call
    (HF's own takes six kernels)."""
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


class RMSNorm(Qwen3RMSNorm):
    """Qwen3's RMSNorm (the same weight under the same name, so checkpoints and serving engines
    see no difference) as `rms_norm`'s one call."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(self, hidden_states)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [..., d] with the signs of HF's rotate_half folded in (see `rotate`)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE in HF's half-rotation convention, x * cos + rotate_half(x) * sin, with rotate_half(x)
    = roll(x) * [-1..., +1...] folded into `sin_signed` (`signed_sin`): two kernels. x [b, H, T, d],
    cos and sin_signed broadcast to it ([b, 1, T, d])."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


class RotaryAngles:
    """A config's RoPE as the tables `rotate` takes. The inverse frequencies live outside any
    module tree on purpose: a bf16 cast of the model (DeepSpeed does one) must not round them."""

    def __init__(self, config):
        rope_type = config.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            init = Qwen3RotaryEmbedding.compute_default_rope_parameters
        else:
            init = ROPE_INIT_FUNCTIONS[rope_type]
        inv_freq, self.scaling = init(config)
        self.inv_freq = inv_freq.float()

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [b, T] -> cos, sin_signed [b, 1, T, d] in `dtype`."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        angles = positions[..., None].float() * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos() * self.scaling, angles.sin() * self.scaling
        return cos.to(dtype)[:, None], signed_sin(sin).to(dtype)[:, None]


_compiled_flex = None


def _flex_attention():
    """flex_attention is only fast when compiled; compile once per process. Dynamic shapes:
    every micro-batch has its own length and block count, and a static compile would recompile
    each step (measured on an H200 with varying shapes: 40 graphs and 377 ms/step static vs
    2 graphs and 40 ms/step dynamic)."""
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex


@dataclass(frozen=True)
class LiveColumns:
    """A mask for rows of one query token that each attend over their own first `lengths[b]`
    columns of a cache [b, Hkv, capacity, d] (batched regeneration: rows at their own columns).
    An additive mask over the batch's span reads every row's keys up to the longest row's; this
    runs FlashAttention's variable-length kernel (flash_varlen) with a key count per row, which
    reads a row's own columns only."""

    lengths: torch.Tensor  # [b] int32: keys each row sees (its column + 1)
    # the sequences' first rows, made by the first layer's call and reused by the others of a step
    _starts: dict = field(default_factory=dict, compare=False, repr=False)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        """q in attend's decoding layout [b, Hkv, group, d] (one token: the rows of a key/value head
        are its query heads) over the whole caches k, v [b, Hkv, capacity, d] -> [b, Hkv, group, d].
        The queries go in as one token of Hq heads, which FlashAttention's decoding path turns back
        into `group` rows per key/value head (each key read once for all of them) and splits over
        the columns when the batch is small. The caches go in without a copy: sequence b starts at
        row b x Hkv x capacity of a strided view whose head stride is capacity x d."""
        b, hkv, group, d = q.shape
        capacity = k.shape[2]
        for cache in (k, v):
            if cache.stride() != (hkv * capacity * d, capacity * d, d, 1):
                raise ValueError(f"LiveColumns needs caches laid out [b, Hkv, capacity, d]; strides {cache.stride()}")

        def packed(cache: torch.Tensor) -> torch.Tensor:
            rows = (b - 1) * hkv * capacity + capacity  # the last sequence's columns end the storage
            return cache.as_strided((rows, hkv, d), (d, capacity * d, 1), cache.storage_offset())

        key = (b, hkv, capacity, q.device)
        if key not in self._starts:
            self._starts[key] = (torch.arange(b + 1, dtype=torch.int32, device=q.device),
                                 torch.arange(0, (b + 1) * hkv * capacity, hkv * capacity, dtype=torch.int32,
                                              device=q.device))
        starts_q, starts_k = self._starts[key]
        out = flash_varlen(q.reshape(b, hkv * group, d), packed(k), packed(v), starts_q, starts_k, 1, capacity, scale,
                           self.lengths)
        return out.view(b, hkv, group, d)


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts_q: torch.Tensor, starts_k: torch.Tensor,
                 max_q: int, max_k: int, scale: float | None, used_k: torch.Tensor | None = None,
                 causal: bool = False) -> torch.Tensor:
    """FlashAttention over packed sequences: sequence i's queries are rows starts_q[i]..starts_q[i + 1] - 1
    of q [rows, Hq, d], its keys/values the first used_k[i] rows from starts_k[i] of k, v [rows, Hkv, d]
    (None: up to starts_k[i + 1]; any row and head strides), `causal` within each sequence; query
    head h uses key/value head h // (Hq / Hkv)."""
    return torch.ops.aten._flash_attention_forward(q, k, v, starts_q, starts_k, max_q, max_k, 0.0, causal, False,
                                                   scale=scale, seqused_k=used_k)[0]


def flash_fits(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Where FlashAttention's kernel runs: NVIDIA GPUs from Ampere on, 16-bit, head dims that are a
    multiple of 8 up to 256, with PyTorch's flash backend on."""
    if device.type != "cuda" or torch.version.hip or dtype not in (torch.bfloat16, torch.float16):
        return False
    if head_dim % 8 or head_dim > 256 or not torch.backends.cuda.flash_sdp_enabled():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def live_columns_supported(device: torch.device, dtype: torch.dtype, head_dim: int, sliding: bool) -> bool:
    """Where LiveColumns runs: FlashAttention's kernel (flash_fits) in a PyTorch whose op takes
    per-row key counts. Targets with sliding layers keep the span mask, which holds their windows
    (LiveColumns has none)."""
    if sliding or not flash_fits(device, dtype, head_dim):
        return False
    schema = str(torch.ops.aten._flash_attention_forward.default._schema)
    return "seqused_k" in schema


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, scale: float | None = None) -> torch.Tensor:
    """Attention of queries q [b, Hq, T, d] over keys/values [b, Hkv, S, d], query head h served
    by key/value head h // (Hq / Hkv), as HF's repeat_kv does; scale defaults to d ** -0.5.
    `mask`: None, a tensor for SDPA [b, 1, T, S] (boolean, True = may attend, or additive), a
    flex-attention BlockMask (CUDA), or LiveColumns (CUDA; k and v the whole caches). Decoding
    passes the query heads that share a key/value head as rows of it, q [b, Hkv, group x T, d] (a
    reshape of [b, Hq, T, d]; row r x T + t is head g x group + r at position t) under a mask of
    as many rows: no copy of the keys/values per head, and SDPA's fused kernels take it (with
    grouped heads and a mask they fall back to math)."""
    if isinstance(mask, LiveColumns):
        return mask.attend(q, k, v, scale)
    if mask is None or isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if torch.compiler.is_compiling():
        # inside a compiled layer flex attention is compiled with it; reading the module global
        # here would add a guard, and one more compiled variant of every layer
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)
    return _flex_attention()(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)
