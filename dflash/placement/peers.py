"""Which peer rank this rank lost, and how. Three sources, the surest first:
  a TransportError     names the peer at the other end of the pair (and whether it went silent);
  the peers' processes on this host (each rank's pid, gathered at start-up): gone, or
                       stopped (SIGSTOP, a debugger);
  a failed collective  gloo and NCCL name an address at most, so only the two above can tell
                       which rank; with one peer in all, it is that one.
A launcher (torchrun, deepspeed, accelerate) sends SIGTERM to the other ranks once one has failed;
Terminated is raised then, with the peers found gone or stopped at that moment.

A killed process closes its sockets a moment before it shows as gone (it frees its memory first,
then its files, and only then becomes a zombie): on a busy host a peer's connection can be seen
dropped while its process still reads as running. So where the error names no peer found gone,
the processes are looked at again for up to EXIT_GRACE_S.
"""

from __future__ import annotations

import os
import re
import time

import torch.distributed as dist

from dflash.placement.distributed import RankInfo, pid_space
from dflash.placement.transport import TransportError

# What gloo and NCCL say when the other end of a connection is gone or silent.
LOST_CONNECTION = re.compile(r"connection (closed|reset) by peer|broken pipe|connection refused|timed out|timeout|"
                             r"remote process exited|ncclRemoteError|communicator was aborted", re.IGNORECASE)
DIED, STOPPED, SILENT, DISCONNECTED = "died", "stopped", "silent", "disconnected"
EXIT_GRACE_S = 1.0  # how long a lost connection waits for its peer's process to show as gone
EXIT_POLL_S = 0.05


class Terminated(KeyboardInterrupt):
    """SIGTERM: a launcher stopping every rank once one failed, or a scheduler. `lost`: the peers
    found gone or stopped when it arrived ({rank: DIED or STOPPED})."""

    def __init__(self, lost: dict[int, str]) -> None:
        super().__init__("SIGTERM")
        self.lost = lost


def is_lost_connection(err: BaseException) -> bool:
    """Whether `err` says a peer is gone or silent: a TransportError, or gloo's or NCCL's error."""
    if isinstance(err, (TransportError, getattr(dist, "DistNetworkError", ()))):
        return True
    if not isinstance(err, RuntimeError):
        return False
    text = str(err)
    from_backend = isinstance(err, getattr(dist, "DistError", ())) or "gloo" in text or "NCCL" in text
    return from_backend and LOST_CONNECTION.search(text) is not None


def process_states(ranks: RankInfo, among: list[int] | None = None) -> dict[int, str]:
    """The ranks (of `among`, default all but this one) whose process on this host is gone (DIED)
    or stopped (STOPPED); ranks on other hosts (or in other containers) are not seen."""
    here = pid_space()
    found = {}
    for rank in among if among is not None else range(ranks.world_size):
        if rank == ranks.rank or rank not in ranks.processes or ranks.processes[rank][0] != here:
            continue
        state = _process_state(ranks.processes[rank][1])
        if state is not None:
            found[rank] = state
    return found


def _process_state(pid: int) -> str | None:
    """DIED (gone, or a zombie its parent has not reaped), STOPPED, or None (running)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]  # the name in parentheses may hold spaces
    except FileNotFoundError:
        return DIED
    except OSError:  # no /proc (not Linux): only whether it exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return DIED
        except PermissionError:
            pass
        return None
    return DIED if state in "ZX" else STOPPED if state in "Tt" else None


def lost_peers(err: BaseException, ranks: RankInfo) -> dict[int, str] | None:
    """lost_peers_of(err), or of the error it was raised from or while handling (a SIGTERM that
    arrived while this rank was taking in a failed transfer, say)."""
    while err is not None:
        lost = lost_peers_of(err, ranks)
        if lost is not None:
            return lost
        err = err.__cause__ or err.__context__
    return None


def lost_peers_of(err: BaseException, ranks: RankInfo) -> dict[int, str] | None:
    """None when `err` says nothing of a lost peer; else {rank: DIED, STOPPED, SILENT or
    DISCONNECTED}, empty when which rank cannot be told. Every peer found gone or stopped on this
    host is named: a rank that exited after losing a peer fails its own transfers too, and which
    of them failed first cannot be told."""
    if isinstance(err, Terminated):
        return err.lost or None
    if not is_lost_connection(err):
        return None
    peer = getattr(err, "peer", None)
    seen = settled_process_states(ranks, peer)
    if peer is not None:  # and the others gone: the peer that failed first may not be the one named
        return {**seen, peer: seen.get(peer, SILENT if err.timed_out else DISCONNECTED)}
    if seen:
        return seen
    others = [r for r in range(ranks.world_size) if r != ranks.rank]
    return {others[0]: DISCONNECTED} if len(others) == 1 else {}


def settled_process_states(ranks: RankInfo, peer: int | None) -> dict[int, str]:
    """process_states, looked at again for up to EXIT_GRACE_S until it shows `peer` (or, with no
    peer named, any rank) gone or stopped: the peer's process may still be on its way out."""
    deadline = time.monotonic() + EXIT_GRACE_S
    seen = process_states(ranks)
    while (peer not in seen if peer is not None else not seen) and time.monotonic() < deadline:
        time.sleep(EXIT_POLL_S)
        seen = process_states(ranks)
    return seen
