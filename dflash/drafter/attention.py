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


# flex attention's sparse tile: query rows x key columns.
FLEX_TILE = 128


def flex_block_mask(layout: BlockLayout, num_query: int):
    """The same pattern as `dense_block_mask`, as a flex-attention BlockMask (CUDA). Which tiles
    hold allowed entries comes from the anchors directly (flex_tiles): torch's create_block_mask
    would evaluate the mask at every (query, key) pair of the micro-batch, about 10^8 of them,
    in a chain of eager int64 kernels each step."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

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

    if FLEX_TILE % bs:  # a block would straddle two query tiles: let torch evaluate the mask
        return create_block_mask(mask_mod, B=b, H=None, Q_LEN=num_query, KV_LEN=s + num_query, device=anchors.device)
    partial, full = flex_tiles(layout, num_query)
    counts, indices = ordered_tiles(partial)
    full_counts, full_indices = ordered_tiles(full)
    return BlockMask.from_kv_blocks(counts, indices, full_counts, full_indices, BLOCK_SIZE=FLEX_TILE,
                                    mask_mod=mask_mod, seq_lengths=(num_query, s + num_query))


def flex_tiles(layout: BlockLayout, num_query: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([b, 1, query tiles, key tiles] bool) the tiles some but not all of whose entries are
    allowed, and those all of whose entries are, for FLEX_TILE-square tiles of the [num_query,
    S + num_query] pattern padded with masked entries (as create_block_mask classifies them). A
    block's rows all see the same columns, its context span and its own slots, so a tile's
    class follows from how many of the tile's columns each block in it sees. Needs FLEX_TILE % B == 0."""
    anchors, valid = layout.anchors, layout.valid
    bs, s, window = layout.block_size, layout.context_len, layout.window
    b, n = anchors.shape
    device = anchors.device
    per_tile = FLEX_TILE // bs
    query_tiles = -(-num_query // FLEX_TILE)
    key_tiles = -(-(s + num_query) // FLEX_TILE)
    slots = query_tiles * per_tile  # blocks past n are padding rows: they see nothing
    ends = torch.nn.functional.pad(anchors.clamp(max=s), (0, slots - n))
    real = torch.nn.functional.pad(valid, (0, slots - n))
    starts = (ends - window).clamp(min=0) if window > 0 else torch.zeros_like(ends)
    tile_start = torch.arange(key_tiles, device=device) * FLEX_TILE
    tile_end = tile_start + FLEX_TILE

    def overlap(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:  # |[lo, hi) & each key tile|
        return (torch.minimum(hi[..., None], tile_end) - torch.maximum(lo[..., None], tile_start)).clamp(min=0)

    context = overlap(starts, ends) * real[..., None]  # [b, slots, key tiles]
    slot_start = s + torch.arange(slots, device=device) * bs
    own = overlap(slot_start, slot_start + bs) * (torch.arange(slots, device=device) < n)[:, None]
    seen = (context + own).view(b, query_tiles, per_tile, key_tiles)
    full = (seen == FLEX_TILE).all(dim=2)
    partial = (seen > 0).any(dim=2) & ~full
    return partial[:, None], full[:, None]


def ordered_tiles(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A BlockMask's (count, key-tile indices) per query tile, the listed tiles first in
    ascending order: the order create_block_mask gives."""
    tiles = tiles.to(torch.int32)
    order = torch.argsort(tiles, dim=-1, descending=True, stable=True)
    return tiles.sum(dim=-1, dtype=torch.int32), order.to(torch.int32)


def build_mask(layout: BlockLayout, backend: str):
    """The mask object the chosen backend consumes."""
    num_query = layout.anchors.shape[1] * layout.block_size
    if backend == "flex":
        return flex_block_mask(layout, num_query)
    return dense_block_mask(layout)
