"""Attention of one batched decode step over a static KV cache: the part of a regeneration step
that takes 80% of its GPU time (BENCHMARKS.md "Real target"). Times the calls StaticTarget makes
(SDPA with an additive mask over the batch's span, the query heads that share a key/value head as
rows of it; on a GPU with the kernel, FlashAttention reading each row's own columns: LiveColumns)
against other ways to compute the same thing, in ms per layer and GB/s of the span's KV cache.

    python -m dflash.benchmarks.decode_attention                      # SmolLM2-135M's heads
    python -m dflash.benchmarks.decode_attention --shapes 1024x768,341x2560 --kv-heads 8 --group 4 --head-dim 128

A shape is rows x used columns (the span StaticTarget reads); each row sees its columns up to a
row-specific end, as rows of different prompt lengths do after left padding.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash.nn.transformer import LiveColumns, attend, live_columns_supported
from dflash.util.cli import cli_parser
from dflash.util.runtime import pick_device, setup_logging

logger = logging.getLogger(__name__)


def decode_inputs(rows: int, span: int, kv_heads: int, group: int, head_dim: int, device: torch.device,
                  dtype: torch.dtype, seed: int = 0) -> dict:
    """Queries [rows, kv_heads, group, d] (one new token per row), keys/values [rows, kv_heads,
    span, d], each row's visible columns (0 .. end - 1) as an additive mask [rows, 1, group, span]
    and as lengths [rows]."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype)

    ends = torch.randint(max(1, span // 2), span + 1, (rows,), generator=generator).to(device)
    visible = torch.arange(span, device=device)[None] < ends[:, None]  # [rows, span]
    mask = torch.zeros(rows, 1, group, span, dtype=dtype, device=device)
    mask.masked_fill_(~visible[:, None, None], float("-inf"))
    return {"q": normal(rows, kv_heads, group, head_dim), "k": normal(rows, kv_heads, span, head_dim),
            "v": normal(rows, kv_heads, span, head_dim), "mask": mask, "ends": ends,
            "scale": head_dim ** -0.5}


def sdpa(x: dict) -> torch.Tensor:
    """StaticTarget's call under the span mask (on a CPU, or without FlashAttention's kernel)."""
    return attend(x["q"], x["k"], x["v"], x["mask"], x["scale"])


def sdpa_backend(backend) -> Callable[[dict], torch.Tensor]:
    def run(x: dict) -> torch.Tensor:
        with torch.nn.attention.sdpa_kernel(backend):
            return sdpa(x)
    return run


def matmul_softmax(x: dict) -> torch.Tensor:
    """Two batched matrix products around a float32 softmax: each reads the cache once."""
    scores = (x["q"] @ x["k"].transpose(-1, -2)).float() * x["scale"] + x["mask"].float()
    return scores.softmax(dim=-1).to(x["v"].dtype) @ x["v"]


def flex(x: dict) -> Callable[[dict], torch.Tensor] | None:
    """FlexAttention (compiled; its decoding kernel splits the columns over thread blocks), with
    grouped-query heads and a block mask of each row's visible columns; CUDA only."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    rows, kv_heads, group, head_dim = x["q"].shape
    span = x["k"].shape[2]
    ends = x["ends"]

    def visible(b, h, q_idx, kv_idx):
        return kv_idx < ends[b]

    block_mask = create_block_mask(visible, rows, None, 1, span, device=x["q"].device)
    compiled = torch.compile(flex_attention, dynamic=False)
    q = x["q"].reshape(rows, kv_heads * group, 1, head_dim)  # query head h = g * group + r uses kv head g

    def run(_: dict) -> torch.Tensor:
        out = compiled(q, x["k"], x["v"], block_mask=block_mask, scale=x["scale"], enable_gqa=True)
        return out.reshape(rows, kv_heads, group, head_dim)
    return run


def live_columns(x: dict) -> torch.Tensor:
    """FlashAttention's variable-length kernel reading each row's own columns (LiveColumns: what
    StaticTarget runs for rows at their own columns where the kernel exists)."""
    return attend(x["q"], x["k"], x["v"], LiveColumns(x["ends"].to(torch.int32)), x["scale"])


def implementations(device: torch.device, dtype: torch.dtype, head_dim: int) -> dict[str, Callable]:
    """name -> (inputs -> run(inputs)); the first is the reference."""
    found = {"sdpa (span mask)": lambda x: sdpa, "matmul + softmax": lambda x: matmul_softmax}
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend

        found["sdpa, efficient backend"] = lambda x: sdpa_backend(SDPBackend.EFFICIENT_ATTENTION)
        found["flex attention"] = flex
    if live_columns_supported(device, dtype, head_dim, sliding=False):
        found["flash varlen (LiveColumns)"] = lambda x: live_columns
    return found


def time_ms(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    run()  # warm-up: compilation, kernel selection
    if device.type != "cuda":
        import time
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        return (time.perf_counter() - start) * 1e3 / repeats
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def compare(shapes: list[tuple[int, int]], kv_heads: int, group: int, head_dim: int, device: torch.device,
            dtype: torch.dtype, repeats: int) -> list[dict]:
    """One row per shape and implementation: ms per call, GB/s of keys and values read, and the
    largest difference from the reference's output."""
    results = []
    for rows, span in shapes:
        x = decode_inputs(rows, span, kv_heads, group, head_dim, device, dtype)
        cache_bytes = 2 * x["k"].numel() * x["k"].element_size()
        reference = None
        for name, build in implementations(device, dtype, head_dim).items():
            run = build(x)
            out = run(x)
            reference = out if reference is None else reference
            ms = time_ms(lambda: run(x), device, repeats)
            results.append({"rows": rows, "span": span, "implementation": name, "ms": round(ms, 4),
                            "kv_gb_per_s": round(cache_bytes / ms / 1e6, 1),
                            "max_abs_diff": float((out.float() - reference.float()).abs().max())})
    return results


@dataclass
class DecodeAttentionArgs:
    shapes: str = field(default="1024x768,341x2560", metadata={"help": "rows x used columns, comma-separated"})
    kv_heads: int = field(default=3, metadata={"help": "key/value heads (SmolLM2-135M: 3)"})
    group: int = field(default=3, metadata={"help": "query heads per key/value head (SmolLM2-135M: 3)"})
    head_dim: int = 64
    dtype: str = "bfloat16"
    device: str = "auto"
    repeats: int = 20
    output: str | None = field(default=None, metadata={"help": "also write the rows as JSON here"})


def parse_shapes(text: str) -> list[tuple[int, int]]:
    try:
        return [(int(a), int(b)) for a, b in (part.split("x") for part in text.split(","))]
    except ValueError:
        raise SystemExit(f"--shapes {text!r}: use rows x span pairs, e.g. 1024x768,341x2560") from None


def main(argv: list[str] | None = None) -> int:
    (args,) = cli_parser(DecodeAttentionArgs).parse_args_into_dataclasses(argv)
    setup_logging(0)
    rows = compare(parse_shapes(args.shapes), args.kv_heads, args.group, args.head_dim, pick_device(args.device, 0),
                   getattr(torch, args.dtype), args.repeats)
    logger.info("| rows | span | implementation | ms per layer | KV GB/s | max abs diff |\n|---|---|---|---|---|---|")
    for r in rows:
        logger.info("| %d | %d | %s | %.3f | %.0f | %.2e |", r["rows"], r["span"], r["implementation"], r["ms"],
                    r["kv_gb_per_s"], r["max_abs_diff"])
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
