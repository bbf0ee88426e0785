"""Run under torchrun (one process): a finite loss whose gradient holds NaN, through a real
DeepSpeed engine with ZeRO stage 1 and 2. Prints, per stage, whether the weights, AdamW's
moments and the LR schedule moved, and the engine's skipped-step count, as JSON."""

from __future__ import annotations

import json

import deepspeed
import torch

from conftest import tiny_drafter, tiny_target


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
        weights = [p.detach().clone() for p in params]
        moments = {k: v.clone() for k, v in engine.optimizer.optimizer.state_dict()["state"][0].items()
                   if isinstance(v, torch.Tensor)}
        lr = scheduler.get_last_lr()[0]
        poisoned = params[0].register_hook(lambda g: torch.full_like(g, float("nan")))
        loss = sum(p.sum() for p in params) * 1e-3
        engine.backward(loss)
        engine.step()
        poisoned.remove()
        after = {k: v for k, v in engine.optimizer.optimizer.state_dict()["state"][0].items()
                 if isinstance(v, torch.Tensor)}
        report[stage] = {
            "loss_finite": bool(torch.isfinite(loss)),
            "weights_moved": any(not torch.equal(w, p.detach()) for w, p in zip(weights, params)),
            "moments_moved": any(not torch.equal(moments[k], after[k]) for k in moments),
            "lr_moved": scheduler.get_last_lr()[0] != lr,
            "skipped_steps": engine.skipped_steps,
        }
    print(json.dumps(report), flush=True)
    torch.distributed.destroy_process_group()  # left to interpreter exit, gloo's threads can abort it


if __name__ == "__main__":
    main()
