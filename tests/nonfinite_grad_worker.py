"""Run under torchrun (one process), through a real DeepSpeed engine with ZeRO stage 1 and 2: a
finite loss whose gradient holds NaN, then a loss spike that the spike guard votes down and
poisons (its backward queued before the verdict is read), then a kept loss. Prints, per stage and
case, whether the weights, AdamW's moments and the LR schedule moved, and the engine's
skipped-step count, as JSON."""

from __future__ import annotations

import json

import deepspeed
import torch

from conftest import tiny_drafter, tiny_target
from dflash.training.spike import SpikeGuard, poisoned


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    report = {}
    for stage in (1, 2):
        drafter = tiny_drafter(tiny_target("qwen3", dtype=torch.float32)).float()
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
        engine, _, _, _ = deepspeed.initialize(
            model=drafter, optimizer=optimizer, lr_scheduler=scheduler,
            config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
                    "gradient_clipping": 1.0, "steps_per_print": 10**9})
        params = list(engine.module.parameters())
        engine.backward(sum(p.sum() for p in params) * 1e-3)  # one good step: moments exist
        engine.step()

        def step_moves(loss_of, settle=lambda: None) -> dict:
            """One engine step on loss_of(params): what it moved."""
            weights = [p.detach().clone() for p in params]
            moments = {k: v.clone() for k, v in engine.optimizer.optimizer.state_dict()["state"][0].items()
                       if isinstance(v, torch.Tensor)}
            lr, skipped = scheduler.get_last_lr()[0], engine.skipped_steps
            loss = loss_of(params)
            engine.backward(loss)
            engine.step()
            after = {k: v for k, v in engine.optimizer.optimizer.state_dict()["state"][0].items()
                     if isinstance(v, torch.Tensor)}
            return {"loss_finite": bool(torch.isfinite(loss)), "guard_skipped": settle(),
                    "weights_moved": any(not torch.equal(w, p.detach()) for w, p in zip(weights, params)),
                    "moments_moved": any(not torch.equal(moments[k], after[k]) for k in moments),
                    "lr_moved": scheduler.get_last_lr()[0] != lr, "skipped_steps": engine.skipped_steps - skipped}

        hooks = []

        def nan_gradient(params):
            hooks.append(params[0].register_hook(lambda g: torch.full_like(g, float("nan"))))
            return sum(p.sum() for p in params) * 1e-3

        guard = SpikeGuard(factor=3.0, warmup=1)
        guard.should_skip(torch.tensor(1.0))  # warm: a loss above 3 is a spike

        def judged(offset: float):
            def loss_of(params):
                loss = sum(p.sum() for p in params) * 1e-3 + offset
                return poisoned(loss, guard.vote(loss))
            return loss_of

        report[stage] = {"nan_gradient": step_moves(nan_gradient)}
        hooks.pop().remove()
        report[stage] |= {"spike": step_moves(judged(100.0), guard.settle),
                          "kept": step_moves(judged(0.0), guard.settle)}
    print(json.dumps(report), flush=True)
    torch.distributed.destroy_process_group()  # left to interpreter exit, gloo's threads can abort it


if __name__ == "__main__":
    main()
