"""The flex-attention BlockMask of one training micro-batch: built from the anchors (what training
does, dflash.drafter.attention.flex_block_mask) against torch's create_block_mask, which evaluates
the mask at every (query, key) pair. Milliseconds a build, and whether the two masks are the same.

    python -m dflash.benchmarks.block_mask --shapes 34x2048x128x8     # the small preset's micro-batch

A shape is sequences x context tokens x anchors a sequence x block size.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask

from dflash.benchmarks.decode_attention import time_ms
from dflash.drafter.attention import BlockLayout, flex_block_mask
from dflash.util.cli import cli_parser
from dflash.util.runtime import pick_device, setup_logging

logger = logging.getLogger(__name__)

MASK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


@dataclass
class BlockMaskArgs:
    shapes: str = field(default="34x2048x128x8", metadata={"help": "sequences x context x anchors x block size, comma-separated"})
    window: int = field(default=0, metadata={"help": "sliding window of the context (0: none)"})
    device: str = "auto"
    repeats: int = 10
    output: str | None = field(default=None, metadata={"help": "also write the rows as JSON here"})


def random_layout(rows: int, context: int, anchors: int, block_size: int, window: int,
                  device: torch.device) -> BlockLayout:
    generator = torch.Generator().manual_seed(0)
    positions = torch.stack([torch.randperm(context - 1, generator=generator)[:anchors].sort().values + 1
                             for _ in range(rows)])
    valid = torch.ones(rows, anchors, dtype=torch.bool)
    return BlockLayout(positions.to(device), valid.to(device), context, block_size, window=window)


def compare(shapes: list[tuple[int, int, int, int]], window: int, device: torch.device, repeats: int) -> list[dict]:
    results = []
    for rows, context, anchors, block_size in shapes:
        layout = random_layout(rows, context, anchors, block_size, window, device)
        queries = anchors * block_size
        ours = flex_block_mask(layout, queries)

        def evaluated():
            return create_block_mask(ours.mask_mod, B=rows, H=None, Q_LEN=queries, KV_LEN=context + queries,
                                     device=device)

        reference = evaluated()
        same = all(torch.equal(getattr(ours, f), getattr(reference, f)) for f in MASK_FIELDS)
        results.append({"rows": rows, "context": context, "anchors": anchors, "block_size": block_size,
                        "from_anchors_ms": round(time_ms(lambda: flex_block_mask(layout, queries), device, repeats), 3),
                        "create_block_mask_ms": round(time_ms(evaluated, device, repeats), 3), "same": same})
    return results


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    try:
        shapes = [tuple(int(x) for x in part.split("x")) for part in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(shape) != 4 for shape in shapes):
        raise SystemExit(f"--shapes {text!r}: use sequences x context x anchors x block size, e.g. 34x2048x128x8")
    return shapes


def main(argv: list[str] | None = None) -> int:
    (args,) = cli_parser(BlockMaskArgs).parse_args_into_dataclasses(argv)
    setup_logging(0)
    rows = compare(parse_shapes(args.shapes), args.window, pick_device(args.device, 0), args.repeats)
    logger.info("| shape | from the anchors, ms | create_block_mask, ms | same mask |\n|---|---|---|---|")
    for r in rows:
        logger.info("| %dx%dx%dx%d | %.3f | %.3f | %s |", r["rows"], r["context"], r["anchors"], r["block_size"],
                    r["from_anchors_ms"], r["create_block_mask_ms"], r["same"])
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
