"""Run under torchrun (one process): a tiny drafter in a DeepSpeed engine, saved by the
Checkpointer four times into <root>/<fault> for each fault named (one process serves several,
since starting DeepSpeed costs more than the saves):

  disk-full   the second save's files fail with ENOSPC (torch.save raises it)
  slow        every file takes 1 s to write, so a test can kill the process mid-save
  nan         the weights turn NaN before the third save
  none        four saves with --keep-checkpoints 2

Prints one JSON line per save: the fault, the step, and what the save did."""

from __future__ import annotations

import errno
import json
import sys
import time

import deepspeed
import torch
import torch.distributed as dist

from conftest import tiny_drafter, tiny_target
from dflash.placement.topology import DrafterParallelism, drafter_groups, plan_topology
from dflash.training import checkpoint


def main(faults: list[str], root: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    topology = plan_topology("colocated", 1)
    data_group, self_group = drafter_groups(topology)
    real_save = torch.save
    for fault in faults:
        drafter = tiny_drafter(tiny_target("qwen3", dtype=torch.float32)).float()
        engine, _, _, _ = deepspeed.initialize(
            model=drafter, optimizer=torch.optim.AdamW(drafter.parameters(), lr=1e-3),
            config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
                    "steps_per_print": 10**9, "checkpoint": {"tag_validation": "Ignore"}},
            mpu=DrafterParallelism(data_group, self_group, topology.drafter_ranks))
        saver = checkpoint.Checkpointer(engine, f"{root}/{fault}", every=1, keep=2 if fault == "none" else 10,
                                        drafter_rank=0, num_drafters=1, group=data_group)

        def faulty_save(obj, path, *args, fault=fault, **kwargs):
            if fault == "disk-full" and "step_2" in str(path):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            if fault == "slow":
                time.sleep(1.0)
            return real_save(obj, path, *args, **kwargs)

        checkpoint.torch.save = faulty_save
        for step in range(1, 5):
            if fault == "nan" and step == 3:
                with torch.no_grad():
                    next(engine.module.parameters()).fill_(float("nan"))
            try:
                saver.save(step, {"step": step})
                saver.wait()
                outcome = "saved"
            except checkpoint.CheckpointError as err:
                outcome = f"error: {err}"
            print(json.dumps({"fault": fault, "step": step, "outcome": outcome}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1].split(","), sys.argv[2])
