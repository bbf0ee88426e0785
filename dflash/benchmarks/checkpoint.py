"""How long a checkpoint holds the step loop: a synchronous DeepSpeed save against the
asynchronous Checkpointer (host snapshot, then a writer thread), on one process.

    python -m dflash.benchmarks.checkpoint                      # ~110M-parameter drafter, CPU
    python -m dflash.benchmarks.checkpoint --hidden-size 4096 --num-layers 5 --device cuda

Reports, per save: the pause of the step loop, and for the asynchronous save also the time
until the checkpoint was committed. State saved: weights, AdamW moments (fp32), LR schedule.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
from transformers import Qwen3Config

from dflash.util.cli import cli_parser


@dataclass
class CheckpointBenchArgs:
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_layers: int = 8
    saves: int = 3
    device: str = "cpu"
    out_dir: str | None = None  # default: a temporary folder


def build_engine(args: CheckpointBenchArgs):
    import deepspeed

    from dflash.drafter.model import DFlashDrafter, drafter_config
    from dflash.placement.topology import DrafterParallelism, drafter_groups, plan_topology

    heads = args.hidden_size // 128
    target = Qwen3Config(vocab_size=1024, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                         num_hidden_layers=36, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                         head_dim=128)
    drafter = DFlashDrafter(drafter_config(target, args.num_layers, [1, 9, 17, 25, 33], 16, 1023)).to(args.device)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    topology = plan_topology("colocated", 1)
    data_group, self_group = drafter_groups(topology)
    engine, _, _, _ = deepspeed.initialize(
        model=drafter, optimizer=optimizer,
        config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}, "steps_per_print": 10**9,
                "checkpoint": {"tag_validation": "Ignore"}},
        mpu=DrafterParallelism(data_group, self_group, topology.drafter_ranks))
    engine.backward(sum(p.sum() for p in engine.module.parameters()) * 1e-6)  # one step: AdamW's moments exist
    engine.step()
    return engine, data_group


def main() -> None:
    (args,) = cli_parser(CheckpointBenchArgs).parse_args_into_dataclasses()
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    from dflash.training.checkpoint import Checkpointer

    deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
    engine, group = build_engine(args)
    params = sum(p.numel() for p in engine.module.parameters())
    root = args.out_dir or tempfile.mkdtemp(prefix="ckpt-bench-")
    sync = []
    for i in range(args.saves):
        started = time.perf_counter()
        engine.save_checkpoint(f"{root}/sync", tag=f"step_{i}", save_latest=False)
        sync.append(time.perf_counter() - started)
    saver = Checkpointer(engine, f"{root}/async", every=1, keep=1, drafter_rank=0, num_drafters=1, group=group)
    committed = []
    for i in range(args.saves):
        started = time.perf_counter()
        saver.save(i + 1, {})
        saver.wait()
        committed.append(time.perf_counter() - started)
    print(json.dumps({
        "parameters_M": round(params / 1e6, 1), "device": args.device, "saves": args.saves,
        "sync_pause_s": round(statistics.median(sync), 3),
        "async_pause_s": round(statistics.median(saver.pauses_s), 3),
        "async_committed_after_s": round(statistics.median(committed), 3),
    }))


if __name__ == "__main__":
    main()
