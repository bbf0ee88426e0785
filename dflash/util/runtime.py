"""What every command sets up first: the device (pick_device) and the log format (setup_logging:
each record carries its rank; only rank 0 speaks at INFO).
"""

from __future__ import annotations

import logging

import torch


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible; use --device cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup_logging(rank: int) -> None:
    """Every record carries its rank; only rank 0 speaks at INFO, others at WARNING."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timing on a GPU); nothing to wait for elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
