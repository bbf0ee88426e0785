"""Run under torchrun: trains a tiny drafter with a DeepSpeed engine for a few steps and saves
the final weights. With 2 processes: ZeRO-2 data parallelism over the drafter group, rank r
takes micro-batch r of every step. With 1 process: gradient accumulation over both micro-batches
of every step (the doubled batch). The micro-batches hold unequal numbers of scored slots.
The loss is CE + D-PACE, so both of its denominators (slot weights, scored slots) are covered.
`global` normalises the loss by the step's denominators, summed over its micro-batches on every
rank, as the trainer does; `local` divides each micro-batch by its own. `pooled` (1 process) is
the reference: both micro-batches as one, the same blocks."""

from __future__ import annotations

import json
import sys

import deepspeed
import torch
import torch.distributed as dist

from conftest import MASK_ID, tiny_drafter, tiny_target
from dflash.drafter_step import DrafterStep, StepSettings
from dflash.attention import BlockLayout
from dflash.objective import LossDenominators, LossTerms, build_blocks, slot_weights
from dflash.topology import DrafterParallelism, drafter_groups, plan_topology

STEPS = 3


def micro_batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + index)
    ids = torch.randint(0, MASK_ID, (2, 24), generator=g)
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:, 6 if index == 0 else 19:] = True  # micro-batch 1 has few scored slots
    return ids, loss_mask


def pool(blocks: list, batches: list):
    """One micro-batch holding the rows and blocks of all of them (padding blocks appended)."""
    n = max(b.layout.anchors.shape[1] for b in blocks)

    def padded(t, fill):
        return torch.cat([t, torch.full((t.shape[0], n - t.shape[1]), fill, dtype=t.dtype)], dim=1)

    first = blocks[0].layout
    layout = BlockLayout(torch.cat([padded(b.layout.anchors, 0) for b in blocks]),
                         torch.cat([padded(b.layout.valid, False) for b in blocks]),
                         first.context_len, first.block_size)
    ids = torch.cat([ids for ids, _ in batches])
    return build_blocks(ids, torch.cat([mask for _, mask in batches]), layout, MASK_ID)


def main(out_path: str, mode: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    topology = plan_topology("colocated", world)
    data_group, self_group = drafter_groups(topology)
    target = tiny_target("qwen3", dtype=torch.float32)
    drafter = tiny_drafter(target, block_size=4).float()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    accumulate = 1 if mode == "pooled" else 2 // world
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": accumulate,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": 2}, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=drafter, optimizer=optimizer, config=config,
                                           mpu=DrafterParallelism(data_group, self_group, topology.drafter_ranks))
    settings = StepSettings(max_anchors=6, slot_weights=slot_weights(4, 4.0), attention_backend="sdpa",
                            terms=LossTerms("ce+dpace"))
    step = DrafterStep(engine.module, target.embed_tokens, target.lm_head, settings, forward=engine)
    mine = [rank] if world == 2 else [0, 1]
    for s in range(STEPS):
        batches = [micro_batch(s, index) for index in mine]
        blocks = [step.sample_blocks(ids, mask, torch.Generator().manual_seed(7 * s + index))
                  for (ids, mask), index in zip(batches, mine)]
        sums = torch.zeros(2, dtype=torch.float64)
        for these in blocks:
            counts = step.denominators(these)
            sums += torch.stack([counts.weight, counts.positions]).double()
        dist.all_reduce(sums, group=data_group)
        denominators = LossDenominators(sums[0].float(), sums[1].float(), scale=2) if mode == "global" else None
        if mode == "pooled":
            batches, blocks = [(torch.cat([ids for ids, _ in batches]), None)], [pool(blocks, batches)]
        for (ids, _), these in zip(batches, blocks):
            engine.backward(step.loss(these, target.features(ids).features, denominators=denominators).loss)
            engine.step()
    if rank == 0:
        state = {k: v.tolist() for k, v in engine.module.state_dict().items()}
        with open(out_path, "w") as f:
            json.dump({"state": state, "global_steps": engine.global_steps}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
