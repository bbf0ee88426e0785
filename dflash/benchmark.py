"""Drafter training-step benchmark on one GPU (random weights, nothing downloaded).

    python -m dflash.benchmark                       # Qwen3-8B-shaped drafter, S=2048, 512x16
    python -m dflash.benchmark --seq-len 3072 --anchors 256 --steps 20

Times drafter forward + backward + AdamW step (features given; the target forward is not
included) and reports step time, draft positions/s (anchors x block size per second), peak
memory and MFU against --peak-tflops. FLOPs counted: 6 x matmul params x tokens for the
trainable layers (queries through every layer, context through fc and k/v projections),
attention 4 x Q x visible keys x heads x head_dim x 3 (fwd + bwd), the frozen lm_head
2 x D x V x scored positions x 2 (fwd + input grad).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import torch
from transformers import HfArgumentParser, Qwen3Config

from dflash.attention import BlockLayout
from dflash.drafter_step import DrafterStep, StepSettings
from dflash.model import DFlashDrafter, drafter_config
from dflash.objective import slot_weights
from dflash.target import TargetOutputs


@dataclass
class BenchArgs:
    seq_len: int = 2048
    anchors: int = 512
    block_size: int = 16
    num_layers: int = 5
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_heads: int = 32
    num_kv_heads: int = 8
    vocab_size: int = 151936
    num_features: int = 5
    batch: int = 1
    steps: int = 10
    warmup: int = 3
    attention_backend: str = "flex"
    peak_tflops: float = 779.0  # H200 bf16 dense matmul, measured
    output: str | None = None


def step_flops(args: BenchArgs, layout: BlockLayout, scored: int) -> float:
    d, hd = args.hidden_size, args.hidden_size // args.num_heads
    kv = args.num_kv_heads * hd
    layer_params = d * d * 2 + d * kv * 2 + 3 * d * args.intermediate_size
    queries = args.batch * args.anchors * args.block_size
    context = args.batch * args.seq_len
    trainable = 6 * (layer_params * queries + 2 * d * kv * context) * args.num_layers
    trainable += 6 * args.num_features * d * d * context
    visible = (layout.anchors.float().sum() + args.block_size * args.anchors * args.batch) * args.block_size
    attention = 4 * float(visible) * args.num_heads * hd * args.num_layers * 3
    lm_head = 2 * d * args.vocab_size * scored * 2
    return trainable + attention + lm_head


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(BenchArgs).parse_args_into_dataclasses(argv)
    device = torch.device("cuda")
    dtype = torch.bfloat16
    torch.manual_seed(0)
    target_config = Qwen3Config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=36, num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
        head_dim=args.hidden_size // args.num_heads, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    config = drafter_config(target_config, args.num_layers, list(range(args.num_features)), args.block_size,
                            args.vocab_size - 1)
    with device:
        drafter = DFlashDrafter(config).to(dtype)
        embed = torch.nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype).requires_grad_(False)
        lm_head = torch.nn.Linear(args.hidden_size, args.vocab_size, bias=False, dtype=dtype).requires_grad_(False)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=True)
    settings = StepSettings(max_anchors=args.anchors, slot_weights=slot_weights(args.block_size, 7.0),
                            attention_backend=args.attention_backend)
    step = DrafterStep(drafter, embed, lm_head, settings)
    ids = torch.randint(0, args.vocab_size - 1, (args.batch, args.seq_len), device=device)
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    loss_mask[:, : args.seq_len // 8] = False
    features = torch.randn(args.batch, args.seq_len, args.num_features * args.hidden_size, device=device, dtype=dtype)
    target = TargetOutputs(features=features)
    generator = torch.Generator().manual_seed(0)
    times = []
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        blocks = step.sample_blocks(ids, loss_mask, generator)
        out = step.loss(blocks, target)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    seconds = sorted(times)[len(times) // 2]
    flops = step_flops(args, blocks.layout, int(blocks.label_mask.sum()))
    result = {
        "config": asdict(args),
        "step_ms": seconds * 1e3,
        "draft_positions_per_s": args.batch * args.anchors * args.block_size / seconds,
        "tflops": flops / seconds / 1e12,
        "mfu": flops / seconds / 1e12 / args.peak_tflops,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
    }
    print(json.dumps(result, indent=2))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
