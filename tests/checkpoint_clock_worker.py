"""Run under torchrun (2 processes, gloo): two drafter ranks' Checkpointers with 1-minute saves
whose clocks disagree (rank 1's runs ahead). Rank 0 prints each rank's verdicts, whether a save
was due after each of two steps, as JSON: they must agree, whichever clock passed the minute."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch
import torch.distributed as dist

from dflash.training.checkpoint import Checkpointer


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    now = [0.0]
    engine = SimpleNamespace(module=torch.nn.Linear(2, 2))
    saver = Checkpointer(engine, "unused", every=0, keep=1, drafter_rank=rank, num_drafters=2, group=None,
                         minutes=1.0, clock=lambda: now[0])
    due = []
    for seconds in (30.0, 50.0):  # rank 0's clock; rank 1's is 45 s ahead at the second step
        now[0] = seconds + (45.0 if rank == 1 and seconds > 30 else 0.0)
        due.append(saver.due(len(due) + 1))
    verdicts: list = [None, None]
    dist.all_gather_object(verdicts, due)
    if rank == 0:
        print(json.dumps(verdicts), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
