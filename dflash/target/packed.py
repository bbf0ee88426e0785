"""Training's target forward over the real tokens only: the rows of a micro-batch packed into one.

A micro-batch is right-padded to its longest row and HF's layers compute every padded position: on
the Qwen2.5-Coder-0.5B replies at --max-tokens 32768, about a third of them (BENCHMARKS.md). Packed,
the rows' real tokens go through the same layers as one sequence, each row's positions counted from
0, and attention keeps each row to itself and causal: FlashAttention's variable-length kernel on a
GPU, SDPA row by row elsewhere. The features come back in the padded [b, S] layout the drafter reads,
zeros at the padding (which no block attends to). The same layers and weights, so the same features
up to the kernels' rounding, and the launches of one padded forward (where --target-length-groups
pays for its saved positions with a forward per group).

`--target-forward packed` turns it on (FrozenTarget.packed_forward): HF targets whose layers take
transformers' attention-function registry and pass the model's keyword arguments down to it (the
Llama, Mistral and Qwen families), without sliding-window layers. `--target-forward auto` (the
default) turns it on wherever it applies (packed_applies): on an H100 it computed the
Qwen2.5-Coder-0.5B's micro-batches in 60.5 ms against 66.9 padded, with identical features, and
training took 9% more steps in the same minutes; on a 2-core CPU, the demo target's in 853 ms
against 1,731 padded and 903 in length groups (BENCHMARKS.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from dflash.nn.transformer import flash_fits, flash_varlen
from dflash.target.frozen import FrozenTarget, TargetError, TargetOutputs
from dflash.target.static import layer_windows
from dflash.util.runtime import to_device_async

PACKED_ATTENTION = "dflash_packed"  # the attention function's name in transformers' registry


@dataclass(frozen=True)
class Packing:
    """Where the real tokens of a right-padded [b, S] batch go when packed into one sequence of T."""

    index: torch.Tensor  # [T] int64: each real token's place in the flattened [b * S] batch
    position_ids: torch.Tensor  # [1, T]: each token's position in its row
    starts: torch.Tensor  # [b + 1] int32: where each row begins among the T tokens (FlashAttention's cu_seqlens)
    bounds: list[int]  # the same on the host (the row-by-row SDPA)
    longest: int

    @staticmethod
    def of(lengths: torch.Tensor, width: int, device: torch.device) -> Packing:
        """From the rows' lengths (on the host, where the collation counted them), copied to the
        device without waiting for its queued work."""
        lengths = torch.as_tensor(lengths, dtype=torch.int64).cpu()
        if lengths.numel() == 0 or int(lengths.min()) < 1 or int(lengths.max()) > width:
            raise ValueError(f"packing rows of lengths {lengths.tolist()} into a batch of width {width}: every row "
                             "needs 1 to width tokens")
        starts = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        starts[1:] = lengths.cumsum(0)
        first_of_row = starts[:-1].repeat_interleave(lengths)
        position = torch.arange(int(starts[-1])) - first_of_row
        row = torch.arange(len(lengths)).repeat_interleave(lengths)
        return Packing(index=to_device_async(row * width + position, device),
                       position_ids=to_device_async(position[None], device),
                       starts=to_device_async(starts.int(), device), bounds=starts.tolist(),
                       longest=int(lengths.max()))

    def unpack(self, packed: torch.Tensor, batch_shape: tuple[int, int]) -> torch.Tensor:
        """[1, T, D] of packed tokens -> [b, S, D], zeros at the padding."""
        b, s = batch_shape
        out = packed.new_zeros(b * s, packed.shape[-1])
        return out.index_copy_(0, self.index, packed[0]).view(b, s, -1)


def packed_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                     scaling: float | None = None, dropout: float = 0.0, dflash_packing: Packing | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [1, Hq, T, d], key/value [1, Hkv, T, d]
    after RoPE -> [1, T, Hq, d], each row of the packing causal over its own tokens."""
    if dflash_packing is None:
        raise TargetError(f"{type(module).__name__}: the packed target forward reached attention without its row "
                          "bounds (this model does not pass its keyword arguments down to attention); use "
                          "--target-forward hf")
    packing = dflash_packing
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, d], no copy
    if flash_fits(q.device, q.dtype, q.shape[-1]):
        out = flash_varlen(q, k, v, packing.starts, packing.starts, packing.longest, packing.longest, scaling,
                           causal=True)
        return out[None], None
    out = torch.empty_like(q)
    for first, end in zip(packing.bounds[:-1], packing.bounds[1:]):
        row = (t[first:end].transpose(0, 1) for t in (q, k, v))
        out[first:end] = F.scaled_dot_product_attention(*row, is_causal=True, scale=scaling,
                                                        enable_gqa=q.shape[1] != k.shape[1]).transpose(0, 1)
    return out[None], None


def packed_forward_problem(target: FrozenTarget) -> str | None:
    """Why the packed forward cannot compute this target's features, or None."""
    config = target.model.config
    if any(layer_windows(config, len(target.layers))):
        return "it has sliding-window layers, which the packed rows' attention does not keep"
    if not hasattr(config, "_attn_implementation"):
        return f"its config ({type(config).__name__}) names no attention implementation to switch"
    return None


def packed_applies(target: FrozenTarget, length_groups: int) -> str | None:
    """Why `--target-forward auto` keeps the padded forward on this rank, or None where it packs."""
    if length_groups > 1:
        return f"--target-length-groups {length_groups} computes the target by groups of rows"
    return packed_forward_problem(target)


def use_packed_rows(target: FrozenTarget) -> None:
    """FrozenTarget.features of `target`, given the rows' lengths, packs the rows from now on."""
    problem = packed_forward_problem(target)
    if problem is not None:
        raise TargetError(f"--target-forward packed: {problem}; use --target-forward hf")
    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    target.packed_forward = functools.partial(packed_features, target)


@torch.no_grad()
def packed_features(target: FrozenTarget, input_ids: torch.Tensor, lengths: torch.Tensor,
                    with_final_hidden: bool) -> TargetOutputs:
    """FrozenTarget.features of right-padded `input_ids` [b, S] whose rows hold `lengths` tokens."""
    packing = Packing.of(lengths, input_ids.shape[1], input_ids.device)
    ids = input_ids.flatten().index_select(0, packing.index)[None]
    config = target.model.config
    before = config._attn_implementation
    # transformers builds no mask for an attention function it has no mask function for
    config._attn_implementation = PACKED_ATTENTION
    try:
        captured, final = target.layer_outputs(ids, with_final_hidden, position_ids=packing.position_ids,
                                               dflash_packing=packing)
    finally:
        config._attn_implementation = before
    shape = tuple(input_ids.shape)
    features = packing.unpack(target.stack_features(captured), shape)
    return TargetOutputs(features=features, final_hidden=packing.unpack(final, shape) if final is not None else None)
