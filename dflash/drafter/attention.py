"""The DFlash attention pattern and the two kernels that run it.

Keys are laid out as `[context (S positions) ; blocks (N blocks x B slots)]` and queries are the
block slots only. A query in block n, whose anchor is `a_n`, sees
  - context positions `t < a_n` (strictly: the anchor's own target features do not exist yet
    at inference time, the anchor is the bonus token the target just produced), and with a
    sliding window W only the last W of them, `a_n - W <= t`;
  - every slot of its own block (bidirectional);
  - nothing of any other block.

CPU (and fallback): a dense boolean mask with SDPA. CUDA: flex attention with a block mask,
which skips the ~85% of tiles that are fully masked.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def resolve_backend(name: str, device: torch.device) -> str:
    """`auto` picks flex attention on CUDA (it has no backward on CPU) and SDPA elsewhere. The
    name itself is checked with the other flags (dflash.config.validate)."""
    if name == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if name == "flex" and device.type != "cuda":
        raise ValueError("--attention-backend flex needs a CUDA device; use sdpa (or auto) on CPU")
    return name


@dataclass
class BlockLayout:
    """Where the blocks of a micro-batch sit: anchors [b, N] and which of them are real."""

    anchors: torch.Tensor  # [b, N] long, anchor position of each block
    valid: torch.Tensor  # [b, N] bool, False for padding blocks
    context_len: int  # S, number of context key positions (padded)
    block_size: int  # B
    window: int = 0  # W > 0: a block sees only the W context positions before its anchor


# Below this many query rows, compiled flex attention switches to its decoding kernel, which has
# no backward: a training micro-batch with few anchors (one sequence, a short reply) would stop
# the run with an InductorError. Padding blocks lift the rows to this floor.
FLEX_MIN_QUERY_ROWS = 128


def pad_blocks(layout: BlockLayout, min_query_rows: int) -> BlockLayout:
    """`layout` with padding blocks (anchor 0, not valid) appended until the blocks hold at least
    `min_query_rows` query rows; padding blocks attend to their own slots only and are never scored."""
    b, n = layout.anchors.shape
    missing = -(-min_query_rows // layout.block_size) - n
    if missing <= 0:
        return layout
    zeros = torch.zeros(b, missing, dtype=layout.anchors.dtype, device=layout.anchors.device)
    return dataclasses.replace(
        layout,
        anchors=torch.cat([layout.anchors, zeros], dim=1),
        valid=torch.cat([layout.valid, zeros.bool()], dim=1),
    )


def dense_block_mask(layout: BlockLayout) -> torch.Tensor:
    """Boolean mask [b, 1, N*B, S + N*B] (True = may attend) for SDPA."""
    anchors, valid = layout.anchors, layout.valid
    b, n = anchors.shape
    bs, s = layout.block_size, layout.context_len
    device = anchors.device
    query_block = torch.arange(n * bs, device=device) // bs  # [Q]
    query_anchor = anchors[:, query_block]  # [b, Q]
    query_valid = valid[:, query_block]  # [b, Q]
    ctx_pos = torch.arange(s, device=device)
    sees_context = ctx_pos[None, None, :] < query_anchor[:, :, None]  # [b, Q, S]
    if layout.window > 0:
        sees_context &= ctx_pos[None, None, :] >= query_anchor[:, :, None] - layout.window
    sees_block = query_block[:, None] == query_block[None, :]  # [Q, Q]
    sees_block = sees_block[None].expand(b, -1, -1)
    mask = torch.cat([sees_context, sees_block], dim=-1) & query_valid[:, :, None]
    # A padding block attends to its own slots only, so no softmax row is empty (no NaN).
    mask[:, :, s:] |= (~query_valid[:, :, None]) & sees_block
    return mask[:, None]


def flex_block_mask(layout: BlockLayout, num_query: int):
    """The same pattern as `dense_block_mask`, as a flex-attention BlockMask (CUDA)."""
    from torch.nn.attention.flex_attention import create_block_mask

    anchors, valid = layout.anchors, layout.valid
    bs, s, window = layout.block_size, layout.context_len, layout.window
    b = anchors.shape[0]

    def mask_mod(batch, head, q_idx, kv_idx):
        q_block = q_idx // bs
        anchor = anchors[batch, q_block]
        is_ctx = kv_idx < s
        kv_block = (kv_idx - s) // bs
        same_block = (~is_ctx) & (kv_block == q_block)
        sees_ctx = is_ctx & (kv_idx < anchor) & valid[batch, q_block]
        if window > 0:
            sees_ctx = sees_ctx & (kv_idx >= anchor - window)
        return sees_ctx | same_block

    return create_block_mask(
        mask_mod, B=b, H=None, Q_LEN=num_query, KV_LEN=s + num_query, device=anchors.device
    )


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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """q [b, Hq, Q, d], k/v [b, Hkv, K, d]; mask is a dense bool tensor, a BlockMask or None."""
    if mask is None or isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    if torch.compiler.is_compiling():
        # inside a compiled layer flex attention is compiled with it; reading the module global
        # here would add a guard, and one more compiled variant of every layer
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    return _flex_attention()(q, k, v, block_mask=mask, enable_gqa=True)


def build_mask(layout: BlockLayout, backend: str):
    """The mask object the chosen backend consumes."""
    num_query = layout.anchors.shape[1] * layout.block_size
    if backend == "flex":
        return flex_block_mask(layout, num_query)
    return dense_block_mask(layout)
