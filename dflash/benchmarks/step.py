"""Drafter training-step benchmark on one GPU (random weights, nothing downloaded).

    python -m dflash.benchmarks.step                       # Qwen3-8B-shaped drafter, S=2048, 512x16
    python -m dflash.benchmarks.step --seq-len 3072 --anchors 256 --steps 20
    python -m dflash.benchmarks.step --kernels naive       # dense SDPA mask, full logits, eager layers
    python -m dflash.benchmarks.step --memory-sweep        # measured peak memory vs dflash/training/memory.py

Times drafter forward + backward + AdamW step (features given; the target forward is not
included: `python -m dflash.benchmarks.e2e` runs the whole training loop) and reports step time,
draft positions/s (anchors x block size per second), peak memory and MFU, counted by the FLOP
model of dflash/drafter/flops.py against the GPU's measured bf16 matmul rate.

--memory-sweep runs one step for each (rows, length, anchors) in the sweep with --hold-gb of
memory held aside (the colocated target's weights: 16.4 GB for Qwen3-8B in bf16), and prints
the step's own memory (peak minus what was allocated before it: weights, optimizer state, the
held memory) next to the memory model's prediction of it (gradients, loss chunk, context
tokens, draft positions), and whether it fitted.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import torch
from transformers import Qwen3Config

from dflash.drafter.flops import CostShapes, drafter_flops, measured_peak_tflops, spec_peak_tflops
from dflash.drafter.model import DFlashDrafter, drafter_config
from dflash.drafter.objective import slot_weights
from dflash.drafter.step import DrafterStep, StepSettings
from dflash.training.memory import (MemoryShapes, WORKSPACE_BYTES, bytes_per_context_token, bytes_per_draft_position,
                                    loss_workspace_bytes)
from dflash.util.cli import cli_parser
from dflash.util.runtime import compile_dynamic

# (rows, sequence length, anchors per row) for --memory-sweep: rows and anchors scale draft
# positions, length scales context tokens; S=3072 up to every position an anchor.
SWEEP = [(1, 2048, 512), (2, 2048, 512), (4, 2048, 512), (1, 3072, 512), (1, 3072, 1024), (1, 3072, 2048),
         (1, 3072, 3071), (2, 3072, 3071), (8, 1024, 512), (4, 3072, 512)]


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
    kernels: str = "fast"  # fast | naive, as train_drafter.py --kernels
    compile_layers: bool = True  # with fast kernels
    memory_sweep: bool = False
    hold_gb: float = 16.4
    output: str | None = None


class Bench:
    """A drafter with its frozen embedding and lm_head, AdamW, and random features."""

    def __init__(self, args: BenchArgs):
        self.args = args
        self.device = torch.device("cuda")
        torch.manual_seed(0)
        target_config = Qwen3Config(
            vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
            num_hidden_layers=36, num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
            head_dim=args.hidden_size // args.num_heads, max_position_embeddings=40960,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )
        config = drafter_config(target_config, args.num_layers, list(range(args.num_features)), args.block_size,
                                args.vocab_size - 1)
        dtype = torch.bfloat16
        with self.device:
            self.drafter = DFlashDrafter(config).to(dtype)
            embed = torch.nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype).requires_grad_(False)
            lm_head = torch.nn.Linear(args.hidden_size, args.vocab_size, bias=False, dtype=dtype).requires_grad_(False)
        fast = args.kernels == "fast"
        if fast and args.compile_layers:
            for layer in self.drafter.layers:
                compile_dynamic(layer)
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=1e-4, fused=True)
        settings = StepSettings(max_anchors=args.anchors, slot_weights=slot_weights(args.block_size, 7.0),
                                attention_backend="flex" if fast else "sdpa", fused_loss=fast,
                                lm_head_chunk=StepSettings.lm_head_chunk if fast else 1 << 62)
        self.step = DrafterStep(self.drafter, embed, lm_head, settings)
        self.params = sum(p.numel() for p in self.drafter.parameters())
        head_dim = args.hidden_size // args.num_heads
        self.cost = CostShapes(hidden=args.hidden_size, intermediate=args.intermediate_size, heads=args.num_heads,
                               kv_heads=args.num_kv_heads, head_dim=head_dim, vocab=args.vocab_size,
                               target_layers_run=0, drafter_layers=args.num_layers, num_features=args.num_features,
                               anchors=args.anchors, block_size=args.block_size)
        self.memory = MemoryShapes(hidden=args.hidden_size, intermediate=args.intermediate_size,
                                   kv_width=args.num_kv_heads * head_dim, layers=args.num_layers,
                                   num_features=args.num_features, vocab=args.vocab_size, anchors=args.anchors,
                                   block_size=args.block_size)

    def inputs(self, rows: int, seq_len: int):
        a = self.args
        ids = torch.randint(0, a.vocab_size - 1, (rows, seq_len), device=self.device)
        loss_mask = torch.ones_like(ids, dtype=torch.bool)
        loss_mask[:, : seq_len // 8] = False
        features = torch.randn(rows, seq_len, a.num_features * a.hidden_size, device=self.device, dtype=torch.bfloat16)
        return ids, loss_mask, features

    def run_step(self, ids, loss_mask, target, generator, anchors: int):
        self.step.settings.max_anchors = anchors
        blocks = self.step.sample_blocks(ids, loss_mask, generator)
        out = self.step.loss(blocks, target)
        out.loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return blocks


def time_steps(bench: Bench) -> dict:
    a = bench.args
    ids, loss_mask, target = bench.inputs(a.batch, a.seq_len)
    generator = torch.Generator().manual_seed(0)
    times = []
    for i in range(a.warmup + a.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        blocks = bench.run_step(ids, loss_mask, target, generator, a.anchors)
        torch.cuda.synchronize()
        if i >= a.warmup:
            times.append(time.perf_counter() - start)
    seconds = sorted(times)[len(times) // 2]
    mean_anchor = float(blocks.layout.anchors[blocks.layout.valid].float().mean())
    flops = a.batch * drafter_flops(bench.cost, a.seq_len, a.anchors, mean_anchor)
    peak = measured_peak_tflops(torch.cuda.current_device())
    spec = spec_peak_tflops(torch.cuda.get_device_name())
    return {
        "step_ms": seconds * 1e3,
        "draft_positions_per_s": a.batch * a.anchors * a.block_size / seconds,
        "tflops": flops / seconds / 1e12,
        "matmul_peak_tflops": peak,
        "mfu": flops / seconds / 1e12 / peak,
        "mfu_of_spec_peak": flops / seconds / 1e12 / spec if spec else None,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30,
    }


def memory_sweep(bench: Bench) -> list[dict]:
    """Peak memory of one step per sweep point, against the memory model's bytes."""
    a = bench.args
    held = torch.empty(int(a.hold_gb * 2**30), dtype=torch.uint8, device=bench.device)  # noqa: F841
    rows_out = []
    for rows, seq_len, anchors in SWEEP:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        generator = torch.Generator().manual_seed(0)
        before = torch.cuda.memory_allocated()
        drawn = min(anchors, seq_len - seq_len // 8 - 1)  # anchors the loss mask allows (see inputs)
        predicted = (2 * bench.params + loss_workspace_bytes(bench.memory) + WORKSPACE_BYTES
                     + rows * seq_len * bytes_per_context_token(bench.memory)
                     + rows * drawn * a.block_size * bytes_per_draft_position(bench.memory, a.kernels == "fast"))
        try:
            ids, loss_mask, target = bench.inputs(rows, seq_len)
            bench.run_step(ids, loss_mask, target, generator, anchors)
            torch.cuda.synchronize()
            measured, fits = torch.cuda.max_memory_allocated() - before, True
        except torch.OutOfMemoryError:
            measured, fits = float("nan"), False
        finally:
            ids = loss_mask = target = None
            bench.optimizer.zero_grad(set_to_none=True)
        row = {"rows": rows, "seq_len": seq_len, "anchors": anchors, "draft_positions": rows * drawn * a.block_size,
               "fits": fits, "step_gb": measured / 2**30, "predicted_gb": predicted / 2**30,
               "peak_gb": torch.cuda.max_memory_allocated() / 2**30}
        print(json.dumps(row), flush=True)
        rows_out.append(row)
    return rows_out


def main(argv: list[str] | None = None) -> dict:
    (args,) = cli_parser(BenchArgs).parse_args_into_dataclasses(argv)
    bench = Bench(args)
    result = {"config": asdict(args), "torch": torch.__version__, "device": torch.cuda.get_device_name()}
    if args.memory_sweep:
        # the AdamW state exists after a first step; warm up once so every point sees it
        ids, loss_mask, target = bench.inputs(1, 1024)
        bench.run_step(ids, loss_mask, target, torch.Generator().manual_seed(0), args.anchors)
        del ids, loss_mask, target
        result["memory_sweep"] = memory_sweep(bench)
    else:
        result.update(time_steps(bench))
    print(json.dumps(result, indent=2))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
