"""Run under torchrun: a few plain SGD steps of a tiny float64 drafter through a real DeepSpeed
engine, ZeRO stage 1 and then 2, recording at every step the gradient the engine is about to
apply (all-reduced over the drafter group and normalised). With 2 processes: data parallelism
over the drafter group, rank r takes micro-batch r of every step. With 1 process: gradient
accumulation over both micro-batches of every step (the doubled batch). The micro-batches hold
unequal numbers of scored slots. The loss is CE + D-PACE, so both of its denominators (slot
weights, scored slots) are covered. `global` normalises the loss by the step's denominators,
summed over its micro-batches on every rank, as the trainer does; `local` divides each
micro-batch by its own. `pooled` (1 process) is the reference: both micro-batches as one, the
same blocks. Rank 0 saves {(mode, stage): [{parameter name: float64 gradient} per step]}."""

from __future__ import annotations

import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_grad

from conftest import MASK_ID, tiny_drafter, tiny_target
from dflash.drafter.attention import BlockLayout
from dflash.drafter.objective import LossDenominators, LossTerms, build_blocks
from dflash.drafter.step import DrafterStep, StepSettings
from dflash.placement.topology import DrafterParallelism, drafter_groups, plan_topology

STEPS = 2
STAGES = (1, 2)
# Powers of two: the loss sums slot weights in float32, and these sums are exact in any order, so
# every mode divides by the same denominators.
SLOT_WEIGHTS = torch.tensor([0.0, 1.0, 0.5, 0.25])
# Plain SGD: the next step starts from weights that differ between modes by float32 rounding at
# most (Adam would divide by each element's gradient scale and magnify that).
LR = 0.1


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


def applied_gradients(mode: str, stage: int, target) -> list[dict[str, torch.Tensor]]:
    """Per step, the gradient of every parameter as the engine holds it before its step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    topology = plan_topology("colocated", world)
    data_group, self_group = drafter_groups(topology)
    drafter = tiny_drafter(target, block_size=4)  # float64, as the target
    accumulate = 1 if mode == "pooled" else 2 // world
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": accumulate,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=drafter, optimizer=torch.optim.SGD(drafter.parameters(), lr=LR),
                                           config=config,
                                           mpu=DrafterParallelism(data_group, self_group, topology.drafter_ranks))
    settings = StepSettings(max_anchors=6, slot_weights=SLOT_WEIGHTS, attention_backend="sdpa",
                            terms=LossTerms("ce+dpace"))
    step = DrafterStep(engine.module, target.embed_tokens, target.lm_head, settings, forward=engine)
    mine = [rank] if world == 2 else [0, 1]
    gradients = []
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
            if engine.is_gradient_accumulation_boundary():  # reduced over ranks and micro-batches by now
                gradients.append({name: safe_get_full_grad(p).to(torch.float64, copy=True)
                                  for name, p in engine.module.named_parameters()})
            engine.step()
    return gradients


def main(out_path: str, modes: list[str]) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    target = tiny_target("qwen3")  # float64
    results = {(mode, stage): applied_gradients(mode, stage, target) for mode in modes for stage in STAGES}
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
