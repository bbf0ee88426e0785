"""The ranks of a launch, for commands whose ranks share out work and only coordinate (sharded
regeneration): torchrun, deepspeed and accelerate export RANK/WORLD_SIZE/LOCAL_RANK (launched);
each rank sees only its own GPU (pin_local_gpu); RankGroup syncs them over gloo (CPU, TCP), whatever
the device, with every wait bounded and a peer that died or stalled named in a PeerError.

The training run's process groups (NCCL, DeepSpeed) are dflash.placement.distributed's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from dflash.util.cli import ConfigError

T = TypeVar("T")
# p2p tags, so that a receive posted early (the end reports) never takes another sync's message
ARRIVED, GO, REPORT = 1, 2, 3


@dataclass(frozen=True)
class Launch:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched() -> Launch:
    """This process's place in its launch; a plain `python` run is rank 0 of 1."""
    rank = _env_int("RANK", 0)
    launch = Launch(rank, _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", rank))
    if not 0 <= launch.rank < launch.world_size or launch.local_rank < 0:
        raise ConfigError(f"environment: RANK={launch.rank}, WORLD_SIZE={launch.world_size}, LOCAL_RANK="
                          f"{launch.local_rank} do not describe a rank of a launch; launch with torchrun, deepspeed "
                          "or accelerate launch, or unset them for a single process")
    return launch


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"environment variable {name}={text!r} is not a number: launch with torchrun, "
                          "deepspeed or accelerate launch, or unset it for a single process") from None


def pin_local_gpu(local_rank: int) -> None:
    """Make the rank's own GPU the only one it sees, as cuda:0, before anything touches CUDA: an
    engine that takes the first visible GPU itself (vLLM) then lands on it, not every rank on GPU 0.
    A CUDA_VISIBLE_DEVICES set by the launcher (deepspeed: the node's GPUs) is indexed by LOCAL_RANK."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d for d in visible.split(",") if d.strip()] if visible is not None else None
    if devices is None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(local_rank)
    elif local_rank < len(devices):
        os.environ["CUDA_VISIBLE_DEVICES"] = devices[local_rank]
    elif devices:
        raise ConfigError(f"LOCAL_RANK {local_rank}, but CUDA_VISIBLE_DEVICES={visible} lists {len(devices)} "
                          "GPUs: start at most that many processes per node, or list more GPUs")


class PeerError(RuntimeError):
    """Another rank died or stalled; `rank` names it (None: not known)."""

    def __init__(self, message: str, rank: int | None) -> None:
        super().__init__(message)
        self.rank = rank


class RankGroup:
    """Syncs the ranks of a launch. A peer that dies shows at once (its sockets close); one that
    stalls, after `timeout_s` (the command's `timeout_flag`). One process needs no group: every
    sync returns at once."""

    def __init__(self, launch: Launch, timeout_s: float, timeout_flag: str) -> None:
        self.launch = launch
        self.timeout_s = timeout_s
        self.timeout_flag = timeout_flag  # named in the error of a wait that ran out
        self._reports: dict[int, tuple[torch.Tensor, dist.Work]] = {}

    def __enter__(self) -> RankGroup:
        if self.launch.world_size > 1:
            dist.init_process_group("gloo", timeout=timedelta(seconds=self.timeout_s))
        return self

    def __exit__(self, *exc) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    @property
    def _peers(self) -> range:
        return range(1, self.launch.world_size)

    def barrier(self, what: str) -> None:
        """Every rank reaches `what`; rank 0 hears from each peer in turn, then lets them go on."""
        if self.launch.world_size == 1:
            return
        token = torch.zeros(1, dtype=torch.long)
        if self.launch.is_main:
            for peer in self._peers:
                self._wait(dist.irecv(token, src=peer, tag=ARRIVED), peer, what)
            for peer in self._peers:
                self._wait(dist.isend(token, dst=peer, tag=GO), peer, what)
        else:
            self._wait(dist.isend(token, dst=0, tag=ARRIVED), 0, what)
            self._wait(dist.irecv(token, src=0, tag=GO), 0, what)

    def from_main(self, make: Callable[[], T], what: str) -> T:
        """Once every rank is here, what rank 0's `make()` returns, on every rank (it must pickle)."""
        if self.launch.world_size == 1:
            return make()
        self.barrier(what)
        value = [make() if self.launch.is_main else None]
        try:
            dist.broadcast_object_list(value, src=0)
        except RuntimeError as err:
            raise PeerError(f"rank {self.launch.rank}: a rank stopped while {what} ({err})", None) from None
        return value[0]

    def open_reports(self, size: int) -> None:
        """Rank 0 posts a receive for each peer's final report now, so that a peer that finishes
        first hands it over and exits without waiting for rank 0 to finish too."""
        if self.launch.is_main:
            for peer in self._peers:
                report = torch.zeros(size, dtype=torch.long)
                self._reports[peer] = report, dist.irecv(report, src=peer, tag=REPORT)

    def report(self, values: list[int], what: str) -> list[list[int]]:
        """Peers hand `values` to rank 0; rank 0 returns every rank's (its own first), waiting for
        each peer at most `timeout_s` from now. open_reports must have run on rank 0."""
        if self.launch.is_main:
            reports = [values]
            for peer, (report, work) in self._reports.items():
                self._wait(work, peer, what)
                reports.append(report.tolist())
            return reports
        self._wait(dist.isend(torch.tensor(values, dtype=torch.long), dst=0, tag=REPORT), 0, what)
        return [values]

    def _wait(self, work: dist.Work, peer: int, what: str) -> None:
        me = f"rank {self.launch.rank}"
        try:
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as err:
            if "timed out" in str(err).lower():
                raise PeerError(f"{me}: rank {peer} did not reach '{what}' within {self.timeout_s:g} s "
                                f"({self.timeout_flag}): it is stalled or far behind; see its log", peer) from None
            raise PeerError(f"{me}: rank {peer} stopped before '{what}' (its connection closed): see its log "
                            "for why", peer) from None
