"""Atomic checkpoints of the drafter ranks, and exact resume.

Layout under <output_dir>/checkpoints/:
  step_<N>/            DeepSpeed engine files (weights, ZeRO-sharded optimizer, LR schedule),
                       rng_rank<r>.pt per drafter rank, trainer_state.json (written LAST)
  latest               the newest complete step directory's name, replaced atomically
A step directory without trainer_state.json was cut off by a crash and is never resumed from.
Target ranks hold no training state and take no part in a save: a resumed run simply asks them
for the remaining batches.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
LATEST_FILE = "latest"


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(engine, output_dir: str | Path, step: int, trainer_state: dict, drafter_rank: int,
                    group) -> Path:
    """Collective over the drafter group. The engine files and every rank's RNG state land
    first; only then does drafter rank 0 mark the directory complete and point `latest` at it."""
    root = checkpoint_dir(output_dir)
    tag = f"step_{step}"
    with barriers_within(group):
        engine.save_checkpoint(str(root), tag=tag, save_latest=False)
    torch.save({"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
               root / tag / f"rng_rank{drafter_rank}.pt")
    dist.barrier(group=group)
    if drafter_rank == 0:
        _write_atomically(root / tag / STATE_FILE, json.dumps(trainer_state, indent=2) + "\n")
        _write_atomically(root / LATEST_FILE, tag + "\n")
        logger.info("checkpoint %s saved", root / tag)
    dist.barrier(group=group)
    return root / tag


@contextlib.contextmanager
def barriers_within(group) -> Iterator[None]:
    """DeepSpeed's save_checkpoint waits at barriers of the WORLD group; in split placement the
    target ranks never reach them. For the save, a barrier without a group means `group`."""
    import deepspeed.comm as ds_comm  # not at import time: DeepSpeed reads DS_ACCELERATOR then

    original = ds_comm.barrier

    def barrier(group_=None, *args, **kwargs):
        return original(group_ if group_ is not None else group, *args, **kwargs)

    ds_comm.barrier = barrier
    try:
        yield
    finally:
        ds_comm.barrier = original


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest COMPLETE step directory, or None."""
    root = checkpoint_dir(output_dir)
    complete = [p for p in root.glob("step_*") if (p / STATE_FILE).is_file()]
    if not complete:
        return None
    return max(complete, key=lambda p: int(p.name.removeprefix("step_")))


def load_checkpoint(engine, path: Path, drafter_rank: int) -> dict:
    """Restore engine, optimizer, LR schedule and this rank's RNG; return the trainer state."""
    _, _ = engine.load_checkpoint(str(path.parent), tag=path.name)
    rng = torch.load(path / f"rng_rank{drafter_rank}.pt", weights_only=False)
    torch.set_rng_state(rng["cpu"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return json.loads((path / STATE_FILE).read_text())
