"""Process-group set-up that works under deepspeed, torchrun, accelerate or plain python.

Launchers export RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT; a plain `python` run gets
a one-process group on a free local port, so the same code path (and a real DeepSpeed engine)
serves every case.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from dflash.util.runtime import pick_device, setup_logging


LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    processes: dict[int, tuple[str, int]] = field(default_factory=dict)  # rank -> (pid_space(), pid)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pid_space() -> str:
    """Where this process's pid means this process: the machine's boot and the pid namespace (a
    container has its own), or the host name where those are not to be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return socket.gethostname()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fill_single_process_env() -> bool:
    """The variables a launcher would set, for a process started without one; True if so.
    (DeepSpeed reads them; the process group itself needs no port then: see init_distributed.)"""
    if "WORLD_SIZE" in os.environ:
        return False
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    return True


def init_distributed(requested_device: str, timeout_minutes: float = 10.0) -> RankInfo:
    """Join (or create) the default process group: NCCL on CUDA, gloo on CPU. Collectives
    that wait longer than the timeout raise instead of hanging."""
    alone = _fill_single_process_env()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(requested_device, local_rank)
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # after DS_ACCELERATOR is settled: DeepSpeed reads it at import

    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        # device_id binds each rank's NCCL communicators to its own GPU up front, instead of
        # NCCL guessing the device from the global rank (wrong when ranks are not GPU-ordered)
        # Alone, the group's store lives in this process: a TCP store would listen on a port found
        # free a moment before, which another process may take first (EADDRINUSE)
        alone_store = {"store": dist.HashStore(), "rank": 0, "world_size": 1} if alone else {}
        dist.init_process_group(backend, timeout=timedelta(minutes=timeout_minutes),
                                device_id=device if device.type == "cuda" else None, **alone_store)
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(minutes=timeout_minutes))
    processes: list[tuple[str, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(processes, (pid_space(), os.getpid()))  # to tell which peer is gone, when one is
    info = RankInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, dict(enumerate(processes)))
    setup_logging(info.rank)
    return info


def shutdown() -> None:
    """Barrier then destroy: a rank that exits without it can abort at exit (rc -6)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def abandon(exit_code: int, wait_s: float = 10.0) -> None:
    """After an error: no barrier (peers may never reach it); NCCL communicators are aborted, since
    a posted transfer whose peer died keeps a plain destroy waiting forever. Even an abort can
    block on a dead peer, so it gets `wait_s`, after which the process exits with `exit_code`."""
    if not dist.is_initialized():
        return

    def tear_down() -> None:
        if dist.get_backend() == "nccl":
            dist.distributed_c10d._abort_process_group()  # every group, the default one included
        else:
            dist.destroy_process_group()

    worker = threading.Thread(target=tear_down, name="abandon-process-group", daemon=True)
    worker.start()
    worker.join(wait_s)
    if worker.is_alive():
        logging.getLogger(__name__).error("process-group teardown still blocked after %g s; exiting", wait_s)
        exit_now(exit_code)


def exit_now(exit_code: int) -> NoReturn:
    """Flush the logs and exit, skipping the interpreter's teardown: a rank that leaves transfers
    posted to a peer (one that stalled, or was interrupted too) can otherwise abort in C++ at exit
    (rc -6, "terminate called without an active exception")."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def rendezvous_store() -> dist.Store:
    """The key-value store the ranks met through (TCP, served by rank 0 or the launcher): messages
    between a few ranks that must not wait for every rank, as a collective would."""
    return dist.distributed_c10d._get_default_store()
