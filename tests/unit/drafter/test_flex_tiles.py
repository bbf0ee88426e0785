"""The flex-attention BlockMask built from the anchors must be the one torch's create_block_mask
builds by evaluating the mask at every (query, key) pair: the same tiles, partial and full, in the
same order, both ways round (the backward pass reads the query-side lists)."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from dflash.drafter.attention import FLEX_TILE, BlockLayout, dense_block_mask, flex_block_mask

FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def layout(b, s, n, block_size, window, seed=0):
    """Sorted anchors in [1, s]; the last row ends in padding blocks (anchor 0), and one real-
    anchored block per row is marked not valid (it must then see no context)."""
    g = torch.Generator().manual_seed(seed)
    anchors = torch.stack([torch.randperm(s, generator=g)[:n].sort().values + 1 for _ in range(b)])
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[:, n // 2] = False
    anchors[-1, -(n // 3):] = 0
    valid[-1, -(n // 3):] = False
    return BlockLayout(anchors, valid, s, block_size, window=window)


CASES = [  # b, S, N, B, W: S and N*B on and off the tile grid, blocks of 8 and 16, windows
    (2, 300, 24, 16, 0), (2, 300, 24, 16, 64), (3, 517, 37, 8, 0), (4, 129, 20, 8, 100),
    (2, 1000, 64, 16, 0), (1, 256, 32, 8, 0), (3, 700, 50, 8, 300),
]


@pytest.mark.parametrize("b, s, n, block_size, window", CASES)
def test_the_block_mask_from_the_anchors_is_the_one_torch_evaluates(b, s, n, block_size, window):
    blocks = layout(b, s, n, block_size, window, seed=s + n)
    ours = flex_block_mask(blocks, n * block_size)
    theirs = create_block_mask(ours.mask_mod, B=b, H=None, Q_LEN=n * block_size, KV_LEN=s + n * block_size,
                               device="cpu")
    assert ours.seq_lengths == theirs.seq_lengths and ours.BLOCK_SIZE == theirs.BLOCK_SIZE
    for field in FIELDS:
        assert torch.equal(getattr(ours, field), getattr(theirs, field)), field
    assert int(theirs.full_kv_num_blocks.sum()) + int(theirs.kv_num_blocks.sum()) > 0


def test_the_tiles_cover_every_allowed_entry_and_full_tiles_hold_nothing_else():
    """Against the dense mask itself: every allowed entry lies in a listed tile, and a full tile
    (skipped by flex's mask check) allows all of its entries."""
    b, s, n, block_size = 3, 900, 64, 8
    blocks = layout(b, s, n, block_size, window=0, seed=1)
    mask = dense_block_mask(blocks)[:, 0]  # [b, Q, S + Q]
    padded = torch.nn.functional.pad(mask, (0, -mask.shape[-1] % FLEX_TILE, 0, -mask.shape[-2] % FLEX_TILE))
    tiles = padded.unflatten(1, (-1, FLEX_TILE)).unflatten(3, (-1, FLEX_TILE)).transpose(2, 3)
    allowed = tiles.sum(dim=(-2, -1))  # [b, query tiles, key tiles]
    ours = flex_block_mask(blocks, n * block_size)
    for row in range(b):
        for q in range(allowed.shape[1]):
            partial = set(ours.kv_indices[row, 0, q, : ours.kv_num_blocks[row, 0, q]].tolist())
            full = set(ours.full_kv_indices[row, 0, q, : ours.full_kv_num_blocks[row, 0, q]].tolist())
            assert set(torch.nonzero(allowed[row, q]).flatten().tolist()) == partial | full
            assert all(allowed[row, q, k] == FLEX_TILE * FLEX_TILE for k in full)
            assert not partial & full


def test_a_block_size_off_the_tile_grid_lets_torch_evaluate_the_mask():
    blocks = layout(2, 300, 20, 12, window=0)
    ours = flex_block_mask(blocks, 20 * 12)
    theirs = create_block_mask(ours.mask_mod, B=2, H=None, Q_LEN=240, KV_LEN=540, device="cpu")
    for field in FIELDS:
        assert torch.equal(getattr(ours, field), getattr(theirs, field)), field


def test_the_block_mask_benchmark_times_both_builds_and_finds_them_equal(tmp_path):
    import json

    from dflash.benchmarks.block_mask import main

    out = tmp_path / "rows.json"
    assert main(["--shapes", "3x400x30x8,2x300x24x16", "--repeats", "1", "--device", "cpu",
                 "--output", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["rows"], r["block_size"]) for r in rows] == [(3, 8), (2, 16)]
    assert all(r["same"] and r["from_anchors_ms"] > 0 and r["create_block_mask_ms"] > 0 for r in rows)
