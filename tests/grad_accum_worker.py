"""Run under torchrun (one process): one optimizer step of 3 accumulated micro-batches through a
real DeepSpeed engine (ZeRO stage 1 and 2, float32), with the training loop's own window
functions, for each loss and pattern of skipped micro-batches. Prints, per case, how far the
gradient the optimizer was handed lies from the gradient of the mean over the kept micro-batches
only (computed with plain autograd on a copy of the drafter), the engine's gradient norm against
that gradient's, and whether the step was applied, as JSON."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import deepspeed
import numpy as np
import torch

from conftest import MASK_ID, tiny_drafter, tiny_target
from dflash.drafter.objective import LossDenominators, LossTerms, anchor_candidates, slot_weights
from dflash.drafter.step import DrafterStep, StepSettings
from dflash.placement.topology import DrafterParallelism, drafter_groups, plan_topology
from dflash.training.run import backward_and_step, kept_loss, micro_batch_loss, plan_window

ACCUM = 3
NO_CLOCK = SimpleNamespace(mark=lambda phase: None)


def micro_batches(target, count: int) -> list[SimpleNamespace]:
    """Micro-batches of different sizes, so that each has its own denominators."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for n in range(count):
        rows, length = 1 + n % 2, 24 + 8 * n
        ids = torch.randint(0, MASK_ID, (rows, length), generator=generator)
        mask = torch.zeros(rows, length, dtype=torch.bool)
        mask[:, 6 + n:] = True
        batches.append(SimpleNamespace(input_ids=ids, loss_mask=mask, features=target.features(ids).features,
                                       final_hidden=None))
    return batches


def kept_mean_gradient(drafter, target, settings, blocks, batches, skipped) -> torch.Tensor:
    """The gradient of sum(kept terms) / (kept denominators), by plain autograd, flat."""
    step = DrafterStep(drafter, target.embed_tokens, target.lm_head, settings)
    kept = [(b, x) for b, x, s in zip(blocks, batches, skipped) if not s]
    weight = sum(float(step.denominators(b).weight) for b, _ in kept)
    positions = sum(float(step.denominators(b).positions) for b, _ in kept)
    denominators = LossDenominators(torch.tensor(weight), torch.tensor(positions))
    for b, x in kept:
        step.loss(b, x.features, denominators=denominators).loss.backward()
    return torch.cat([p.grad.flatten() for p in drafter.parameters()])


def one_case(stage: int, kind: str, skipped: list[bool], groups, topology) -> dict:
    target = tiny_target("qwen3", dtype=torch.float32)
    drafter = tiny_drafter(target).float()
    reference = copy.deepcopy(drafter)
    settings = StepSettings(max_anchors=6, slot_weights=slot_weights(drafter.block_size, 2.0),
                            attention_backend="sdpa", terms=LossTerms(kind))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(
        model=drafter, optimizer=optimizer,
        config={"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": ACCUM,
                "zero_optimization": {"stage": stage}, "gradient_clipping": 1e9, "steps_per_print": 10**9},
        mpu=DrafterParallelism(groups[0], groups[1], topology.drafter_ranks))
    handed = []
    real_step = optimizer.step

    def recording_step(*args, **kwargs):  # the fp32 gradient partition the update is made from
        handed.append(torch.cat([p.grad.flatten() for g in optimizer.param_groups for p in g["params"]]))
        return real_step(*args, **kwargs)

    optimizer.step = recording_step
    step = DrafterStep(engine.module, target.embed_tokens, target.lm_head, settings, forward=engine)
    batches = micro_batches(target, ACCUM)
    # window item n holds micro-batch n: its anchor count is its widest row's, as the sampler counts them
    anchors = np.array([max(1, min(settings.max_anchors, int(anchor_candidates(b.loss_mask).sum(1).max())))
                        for b in batches])
    run = SimpleNamespace(engine=engine, step=step, total_steps=10, drafter_rank=0, anchors=anchors)
    ctx = SimpleNamespace(config=SimpleNamespace(train=SimpleNamespace(grad_accum=ACCUM, seed=0, kl_weight=0.0,
                                                                       feature_noise_std=0.0)),
                          ranks=SimpleNamespace(device=torch.device("cpu")), data_group=groups[0], topology=topology)
    window = [(0, n, [n], batch, (n, 0)) for n, batch in enumerate(batches)]
    blocks, denominators, per_micro = plan_window(ctx, run, window, NO_CLOCK)
    verdicts = []
    for (_, _, _, batch, _), these, skip in zip(window, blocks, skipped):
        verdicts.append(skip)
        out = step.empty_loss() if skip else micro_batch_loss(ctx, run, batch, these, denominators)
        loss, scale, _ = kept_loss(ctx, run, out.loss, verdicts, per_micro)
        backward_and_step(run, loss, NO_CLOCK, scale)
    record = {"stage": stage, "kind": kind, "skipped": skipped, "applied": bool(handed),
              "skipped_steps": engine.skipped_steps}
    if handed and not all(skipped):
        want = kept_mean_gradient(reference, target, settings, blocks, batches, skipped)
        got = handed[0][:want.numel()]
        record["relative_error"] = float((got - want).norm() / want.norm())
        record["norm"], record["want_norm"] = float(engine.get_global_grad_norm()), float(want.norm())
    return record


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    topology = plan_topology("colocated", 1)
    groups = drafter_groups(topology)
    cases = [(1, "ce", [False, True, False]), (2, "ce", [True, False, False]), (1, "dpace", [False, False, True]),
             (1, "ce", [False, False, False]), (1, "ce", [True, True, True]), (1, "ce+dpace", [False, True, False])]
    for stage, kind, skipped in cases:
        print(json.dumps(one_case(stage, kind, skipped, groups, topology)), flush=True)
    torch.distributed.destroy_process_group()  # left to interpreter exit, gloo's threads can abort it


if __name__ == "__main__":
    main()
