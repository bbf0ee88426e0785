"""The DFlash drafter: a few Qwen3-style layers whose keys/values see the target's features.

Read top to bottom:
  context features  [b, S, K*D] --fc--> hidden_norm --> context [b, S, D]
  block tokens      [x_a, MASK, ..., MASK] embedded by the FROZEN target embedding [b, Q, D]
  each layer:  q from the block; k/v from [context ; block] with the same k_proj/v_proj,
               k_norm and RoPE at absolute positions; residual + MLP on the block only
  final norm --> hidden [b, Q, D]; the frozen TARGET lm_head turns it into logits.

The drafter owns no embedding and no lm_head: they stay with the target and are passed in. With
a draft vocabulary (dflash/drafter/vocab.py) it holds the ids of the lm_head rows it drafts from.
The config is a plain `Qwen3Config` (so exported folders read as Qwen3 layers) with the DFlash
fields `block_size`, `num_target_layers` and `dflash_config` added.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

from dflash.nn.transformer import RMSNorm, RotaryAngles, attend, rotate


def full_attention_rope(text_config) -> dict:
    """The target's RoPE for full-attention layers (drafter layers are full attention). Targets
    with per-layer-type RoPE (Gemma 3: sliding and full layers differ) nest it by layer type."""
    rope = getattr(text_config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    if isinstance(rope.get("full_attention"), dict):
        rope = rope["full_attention"]
    return dict(rope)


def drafter_config(
    target_config,
    num_layers: int,
    target_layer_ids: list[int],
    block_size: int,
    mask_token_id: int,
    window: int = 0,
    draft_vocab: int = 0,
) -> Qwen3Config:
    """A drafter config with the target's width, heads and RoPE, and the DFlash fields. `window`
    > 0: sliding-window layers, written in the keys serving engines read (`layer_types`,
    `sliding_window`, `dflash_config.use_swa` / `swa_window_size`); `draft_vocab` > 0: it drafts
    from that many of the target's tokens (`dflash_config.draft_vocab_size`)."""
    text_config = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    hidden = text_config.hidden_size
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or hidden // heads
    config = Qwen3Config(
        vocab_size=text_config.vocab_size,
        hidden_size=hidden,
        intermediate_size=text_config.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(text_config, "num_key_value_heads", heads),
        head_dim=head_dim,
        rms_norm_eps=getattr(text_config, "rms_norm_eps", 1e-6),
        max_position_embeddings=text_config.max_position_embeddings,
        rope_parameters=full_attention_rope(text_config),
        attention_bias=False,
        tie_word_embeddings=False,
        **({"use_sliding_window": True, "sliding_window": window, "max_window_layers": 0,
            "layer_types": ["sliding_attention"] * num_layers} if window > 0 else {}),
    )
    config.architectures = ["DFlashDraftModel"]
    config.block_size = block_size
    config.num_target_layers = text_config.num_hidden_layers
    config.dflash_config = {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)}
    if window > 0:
        config.dflash_config.update(use_swa=True, swa_window_size=window)
    if draft_vocab:
        config.dflash_config["draft_vocab_size"] = draft_vocab
    return config


class DFlashAttention(nn.Module):
    """GQA attention whose keys/values are the projected context followed by the block."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        d, hq, hkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.num_heads, self.num_kv_heads = d, hq, hkv
        self.q_proj = nn.Linear(config.hidden_size, hq * d, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, hkv * d, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, hkv * d, bias=False)
        self.o_proj = nn.Linear(hq * d, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(d, eps=config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)  # [b, n, t, d]

    def key_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Keys (normed, rotated) and values [b, Hkv, T, d] of x [b, T, D]; cos and sin as
        RotaryAngles gives them (sin with rotate_half's signs folded in)."""
        k = rotate(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), cos, sin)
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        return k, v

    def forward(self, block, cos, sin, context_k, context_v, mask, columns=None, qkv=None) -> torch.Tensor:
        """Training: keys/values are the context's followed by the block's, under `mask` from
        dflash.drafter.attention. Decoding (`columns` given): context_k/v are a DrafterCache
        layer; the block's keys/values are written into it at `columns` [B] (anchor + k, whose
        context entries the block may not see, and which the next extend_context rewrites), and
        the block attends to the whole cache under the additive `mask` [b, 1, group x B, capacity].
        `qkv`: this layer's StackedProjections weight, one product for q, k and v."""
        if qkv is None:
            q = rotate(self.q_norm(self._heads(self.q_proj(block), self.num_heads)), cos, sin)
            k, v = self.key_values(block, cos, sin)
        else:
            q, k, v = self._heads(F.linear(block, qkv), self.num_heads + 2 * self.num_kv_heads).split(
                [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
            q, k = rotate(self.q_norm(q), cos, sin), rotate(self.k_norm(k), cos, sin)
        b, _, t, d = q.shape
        if columns is None:
            out = attend(q, torch.cat([context_k, k], dim=2), torch.cat([context_v, v], dim=2), mask)  # [b, Hq, Q, d]
        else:
            context_k.index_copy_(2, columns, k)
            context_v.index_copy_(2, columns, v)
            rows = q.reshape(b, self.num_kv_heads, -1, d)  # the heads that share a key/value head: rows of it
            out = attend(rows, context_k, context_v, mask).reshape(b, -1, t, d)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DFlashLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)

    def forward(self, block, cos, sin, context_k, context_v, mask, columns=None, qkv=None) -> torch.Tensor:
        block = block + self.self_attn(self.input_layernorm(block), cos, sin, context_k, context_v, mask, columns, qkv)
        return block + self.mlp(self.post_attention_layernorm(block))


@dataclass
class DrafterCache:
    """Per-layer keys/values of the committed context at a fixed capacity, for decoding: column t
    holds position t. A draft attends only to columns before its anchor, so columns written for
    tokens that were then rejected are never seen, and are rewritten once the context reaches
    them; fixed shapes let a draft step replay as a CUDA graph."""

    keys: torch.Tensor  # [layers, b, Hkv, capacity, d]
    values: torch.Tensor

    @classmethod
    def allocate(cls, config: Qwen3Config, batch: int, capacity: int, device: torch.device,
                 dtype: torch.dtype) -> "DrafterCache":
        shape = (config.num_hidden_layers, batch, config.num_key_value_heads, capacity, config.head_dim)
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]


@dataclass
class StackedProjections:
    """The drafter's projections that decoding applies to one input, each stacked into one weight
    (copies, made once per decoder): every layer's context keys and values (one matrix product
    where there were 2 x layers) and each layer's block queries, keys and values (one where there
    were 3). A batch-1 decode step is bound by its kernel count; training keeps them apart."""

    context_kv: torch.Tensor  # [layers x 2 x Hkv x d, D]: layer 0's keys, its values, layer 1's keys, ...
    block_qkv: list[torch.Tensor]  # per layer [(Hq + 2 Hkv) x d, D]

    @classmethod
    @torch.no_grad()
    def of(cls, drafter: "DFlashDrafter") -> "StackedProjections":
        attentions = [layer.self_attn for layer in drafter.layers]
        return cls(torch.cat([w for a in attentions for w in (a.k_proj.weight, a.v_proj.weight)]),
                   [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]) for a in attentions])


def head_vocab_size(config: Qwen3Config) -> int:
    """Rows of the lm_head the drafter scores with: its draft vocabulary's, or all the target's."""
    return config.dflash_config.get("draft_vocab_size") or config.vocab_size


class DFlashDrafter(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        draft_vocab = config.dflash_config.get("draft_vocab_size")
        if draft_vocab:  # the target ids of the rows it drafts from (dflash/drafter/vocab.py), set by training
            self.register_buffer("draft_to_target", torch.arange(draft_vocab))
        num_features = len(config.dflash_config["target_layer_ids"])
        self.fc = nn.Linear(num_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary = RotaryAngles(config)
        self.reset_parameters()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.dflash_config["mask_token_id"]

    @property
    def window(self) -> int:
        """Context positions a block sees before its anchor (0: all of them)."""
        dflash = self.config.dflash_config
        return int(dflash.get("swa_window_size", 0)) if dflash.get("use_swa") else 0

    def reset_parameters(self) -> None:
        std = getattr(self.config, "initializer_range", 0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def fuse_context(self, features: torch.Tensor) -> torch.Tensor:
        """[b, S, K*D] target features -> [b, S, D] context vectors."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        context_features: torch.Tensor,
        context_positions: torch.Tensor,
        mask,
    ) -> torch.Tensor:
        """Training forward: every block of every sequence at once.

        block_embeds [b, Q, D] (Q = N blocks x B slots), block_positions [b, Q],
        context_features [b, S, K*D], context_positions [b, S], mask from dflash.drafter.attention.
        Returns the final-normed hidden states [b, Q, D].
        """
        context = self.fuse_context(context_features)
        ctx_cos, ctx_sin = self.rotary(context_positions, context.dtype)
        cos, sin = self.rotary(block_positions, block_embeds.dtype)
        x = block_embeds.to(context.dtype)
        for layer in self.layers:
            ck, cv = layer.self_attn.key_values(context, ctx_cos, ctx_sin)
            x = layer(x, cos, sin, ck, cv, mask)
        return self.norm(x)

    @torch.no_grad()
    def extend_context(self, cache: DrafterCache, features: torch.Tensor, positions: torch.Tensor,
                       stacked: StackedProjections | None = None) -> None:
        """Write tokens' target features [b, T, K*D] at `positions` [1, T] (one set for all rows);
        with `stacked`, every layer's keys and values come from one matrix product."""
        context = self.fuse_context(features)
        cos, sin = self.rotary(positions, context.dtype)
        if stacked is None:
            keys_values = [layer.self_attn.key_values(context, cos, sin) for layer in self.layers]
        else:
            b, t, _ = context.shape
            kv = F.linear(context, stacked.context_kv).view(b, t, len(self.layers), 2, self.config.num_key_value_heads,
                                                            self.config.head_dim)
            keys_values = [(rotate(layer.self_attn.k_norm(kv[:, :, i, 0].transpose(1, 2)), cos, sin),
                            kv[:, :, i, 1].transpose(1, 2)) for i, layer in enumerate(self.layers)]
        for i, (k, v) in enumerate(keys_values):
            cache.keys[i].index_copy_(2, positions[0], k)
            cache.values[i].index_copy_(2, positions[0], v)

    @torch.no_grad()
    def draft(self, cache: DrafterCache, block_embeds: torch.Tensor, block_positions: torch.Tensor,
              stacked: StackedProjections | None = None) -> torch.Tensor:
        """Inference forward of one block per sequence over the cached context: the block sees
        the context columns before its anchor (the last `window` of them with a sliding window)
        and all of its own slots, whose keys/values it writes at their positions' columns.
        block_positions [1, B] (one set for all rows, as in extend_context), anchor first;
        `stacked`: each layer's q, k and v from one matrix product. Returns [b, B, D]."""
        columns = block_positions[0]
        anchor = columns[0]
        cache_columns = torch.arange(cache.capacity, device=columns.device)
        sees = cache_columns < anchor + len(columns)
        if self.window > 0:
            sees = sees & (cache_columns >= anchor - self.window)
        dtype = self.fc.weight.dtype
        rows = self.config.num_attention_heads // self.config.num_key_value_heads * len(columns)
        mask = torch.zeros(cache.capacity, dtype=dtype, device=columns.device).masked_fill_(~sees, float("-inf"))
        mask = mask.expand(block_embeds.shape[0], 1, rows, -1)  # one additive mask for every layer
        cos, sin = self.rotary(block_positions, block_embeds.dtype)
        x = block_embeds.to(dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.keys[i], cache.values[i], mask, columns,
                      None if stacked is None else stacked.block_qkv[i])
        return self.norm(x)
