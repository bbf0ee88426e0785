"""A run that lost a peer rank (it died, stopped, or went silent): the one line each surviving rank
gives of it (PeerLost: this rank, its step, which rank was lost and how, where that rank's log is),
and where an error that says so becomes it (peer_losses_reported). train_drafter.py adds the
newest checkpoint and the resume command, logs the line and exits non-zero, without a traceback.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Callable, Iterator

from dflash.placement.distributed import RankInfo
from dflash.placement.peers import DIED, DISCONNECTED, SILENT, STOPPED, Terminated, lost_peers
from dflash.placement.topology import Topology

HOW = {STOPPED: "is stopped (SIGSTOP, or a debugger holds it: its process does not run)",
       DIED: "died or exited", SILENT: "stopped answering (for --transport-timeout-s)",
       DISCONNECTED: "dropped its connection"}
# a stopped peer comes first: the ranks that were waiting on it time out and exit, and then look
# gone to the others too
ORDER = {how: i for i, how in enumerate(HOW)}
BACKEND_PREFIX = re.compile(r"\[[^\]]*\.(cc|cpp|hpp|h):\d+\] ")  # gloo's and NCCL's source location
OUR_PREFIX = re.compile(r"^rank \d+ \(\w+\)[,:] ")  # a TransportError's own "rank R (role), " opening


class PeerLost(RuntimeError):
    """This rank lost the peers `lost` ({rank: how}; empty when which one cannot be told)."""

    def __init__(self, rank: int, role: str | None, step: int | None, lost: dict[int, str],
                 roles: dict[int, str], out_dir: Path, cause: BaseException) -> None:
        self.rank, self.role, self.step, self.lost = rank, role, step, lost
        me = f"rank {rank}" + (f" ({role})" if role else "")
        me += f" at step {step}" if step is not None else " during set-up"
        if lost:
            accounts = "; ".join(_account(peer, how, roles.get(peer), out_dir)
                                 for peer, how in sorted(lost.items(), key=lambda item: (ORDER[item[1]], item[0])))
        else:
            accounts = ("a peer rank is gone or silent (the launcher's report, or the first error of the other ranks, "
                        "names it)")
        super().__init__(f"{me}: {accounts} [{short_cause(cause)}]")


def _account(peer: int, how: str, role: str | None, out_dir: Path) -> str:
    name = f"{role} rank {peer}" if role else f"rank {peer}"
    log = f"its log: the lines tagged [rank{peer}] in the launcher's output"
    if role == "target":
        log += f", its progress: {out_dir / 'target_metrics' / f'rank{peer}.jsonl'}"
    return f"{name} {HOW[how]} ({log})"


def short_cause(err: BaseException) -> str:
    """What the error itself says, in one short line: its innermost cause, without source locations."""
    if isinstance(err, Terminated):
        return "SIGTERM: a launcher stops every rank once one has failed"
    while err.__cause__ is not None:
        err = err.__cause__
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    text = OUR_PREFIX.sub("", BACKEND_PREFIX.sub("", text))
    return re.split(r" \[peer: |\. This is typically|\. Check ", text)[0][:200]


def roles(topology: Topology | None) -> dict[int, str]:
    """Each rank's role in split placement; none in colocated placement, where every rank has both."""
    if topology is None or topology.colocated:
        return {}
    return {r: "target" if topology.is_target(r) else "drafter" for r in range(topology.world_size)}


def peer_lost(err: BaseException, ranks: RankInfo, topology: Topology | None, step: int | None,
              out_dir: Path) -> PeerLost | None:
    """`err` as this rank's PeerLost, or None where it says nothing of a lost peer."""
    lost = lost_peers(err, ranks)
    if lost is None:
        return None
    return PeerLost(ranks.rank, roles(topology).get(ranks.rank), step, lost, roles(topology), out_dir, err)


@contextlib.contextmanager
def peer_losses_reported(ranks: RankInfo, topology: Topology, out_dir: Path, step: Callable[[], int | None],
                         on_loss: Callable[[], None] | None = None) -> Iterator[None]:
    """Inside: an error that says a peer is gone (a transport error, a failed collective, a launcher's
    SIGTERM after a peer died) leaves as PeerLost, with step() the step this rank had reached;
    on_loss() runs first (a drafter's checkpointer stops committing)."""
    try:
        yield
    except PeerLost:
        raise
    except BaseException as err:
        lost = peer_lost(err, ranks, topology, step(), out_dir)
        if lost is None:
            raise
        if on_loss is not None:
            on_loss()
        raise lost from err
