"""Run under torchrun: trains a tiny drafter with a DeepSpeed engine for a few steps and saves
the final weights. With 2 processes: ZeRO-2 data parallelism over the drafter group, rank r
takes micro-batch r of every step. With 1 process: gradient accumulation over both micro-batches
of every step (the doubled batch). The two must end with the same weights."""

from __future__ import annotations

import json
import sys

import deepspeed
import torch
import torch.distributed as dist

from conftest import MASK_ID, tiny_drafter, tiny_target
from dflash.drafter_step import DrafterStep, StepSettings
from dflash.objective import slot_weights
from dflash.topology import DrafterParallelism, drafter_groups, plan_topology

STEPS = 3


def micro_batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + index)
    ids = torch.randint(0, MASK_ID, (2, 24), generator=g)
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:, 6:] = True
    return ids, loss_mask


def main(out_path: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    topology = plan_topology("colocated", world)
    data_group, self_group = drafter_groups(topology)
    target = tiny_target("qwen3", dtype=torch.float32)
    drafter = tiny_drafter(target, block_size=4).float()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2 // world,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": 2}, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=drafter, optimizer=optimizer, config=config,
                                           mpu=DrafterParallelism(data_group, self_group, topology.drafter_ranks))
    settings = StepSettings(max_anchors=6, slot_weights=slot_weights(4, 4.0), attention_backend="sdpa")
    step = DrafterStep(engine.module, target.embed_tokens, target.lm_head, settings, forward=engine)
    mine = [rank] if world == 2 else [0, 1]
    for s in range(STEPS):
        for index in mine:
            ids, loss_mask = micro_batch(s, index)
            blocks = step.sample_blocks(ids, loss_mask, torch.Generator().manual_seed(7 * s + index))
            engine.backward(step.loss(blocks, target.features(ids).features).loss)
            engine.step()
    if rank == 0:
        state = {k: v.tolist() for k, v in engine.module.state_dict().items()}
        with open(out_path, "w") as f:
            json.dump({"state": state, "global_steps": engine.global_steps}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
