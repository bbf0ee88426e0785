"""The DFlash attention pattern, as the mask each of the two kernels takes.

Keys are laid out as `[context (S positions) ; blocks (N blocks x B slots)]` and queries are the
block slots only. A query in block n, whose anchor is `a_n`, sees
  - context positions `t < a_n` (strictly: the anchor's own target features do not exist yet
    at inference time, the anchor is the bonus token the target just produced), and with a
    sliding window W only the last W of them, `a_n - W <= t`;
  - every slot of its own block (bidirectional);
  - nothing of any other block.

CPU (and fallback): a dense boolean mask with SDPA. CUDA: flex attention with a block mask,
which skips the ~85% of tiles that are fully masked. Both run through dflash.nn.transformer.attend.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


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


def build_mask(layout: BlockLayout, backend: str):
    """The mask object the chosen backend consumes."""
    num_query = layout.anchors.shape[1] * layout.block_size
    if backend == "flex":
        return flex_block_mask(layout, num_query)
    return dense_block_mask(layout)
