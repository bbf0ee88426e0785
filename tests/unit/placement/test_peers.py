"""Which peer a rank lost, and the one line a surviving rank gives of it (dflash/placement/peers.py,
dflash/training/peer_loss.py): a transport error names the peer, a failed collective does not, and
the peers' processes on this host tell a dead rank from a stopped one."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from dflash.placement.distributed import RankInfo, pid_space
from dflash.placement.peers import DIED, DISCONNECTED, SILENT, STOPPED, Terminated, lost_peers, process_states
from dflash.placement.topology import Topology
from dflash.placement.transport import TransportError
from dflash.training.peer_loss import peer_lost

GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:5820. This is typically caused by a remote worker crashing. Check the logs of the remote "
               "worker before reporting an error. GLHF!")
SPLIT = Topology(3, target_ranks=[2], drafter_ranks=[0, 1])


def rank_info(rank: int, pids: dict[int, int], world: int = 3) -> RankInfo:
    here = pid_space()
    return RankInfo(rank, world, rank, torch.device("cpu"), {r: (here, pid) for r, pid in pids.items()})


@pytest.fixture
def peer_process():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def test_the_processes_on_this_host_tell_a_dead_peer_from_a_stopped_one(peer_process):
    ranks = rank_info(0, {1: peer_process.pid, 2: 0x7FFFFFF0}, world=4)  # rank 2: no such process; 3: unknown
    assert process_states(ranks) == {2: DIED}
    peer_process.send_signal(signal.SIGSTOP)
    time.sleep(0.2)
    assert process_states(ranks) == {1: STOPPED, 2: DIED}
    peer_process.kill()
    time.sleep(0.2)  # a zombie, not reaped yet: gone all the same
    assert process_states(ranks, among=[1]) == {1: DIED}
    elsewhere = RankInfo(0, 2, 0, torch.device("cpu"), {1: ("another-host", 0x7FFFFFF0)})
    assert process_states(elsewhere) == {}  # not seen from here


def test_a_failed_collective_names_the_peer_found_gone_or_none(peer_process):
    collective = RuntimeError(GLOO_CLOSED)
    assert lost_peers(collective, rank_info(0, {1: peer_process.pid, 2: 0x7FFFFFF0})) == {2: DIED}
    assert lost_peers(collective, rank_info(0, {1: peer_process.pid, 2: peer_process.pid})) == {}  # cannot tell
    assert lost_peers(collective, rank_info(0, {1: peer_process.pid}, world=2)) == {1: DISCONNECTED}  # the only one
    for unrelated in (RuntimeError("CUDA error: an illegal memory access"), ValueError("Connection closed by peer")):
        assert lost_peers(unrelated, rank_info(0, {1: 0x7FFFFFF0})) is None


def test_a_peer_whose_process_is_still_on_its_way_out_is_named_gone():
    """A killed peer's connection drops a moment before its process shows as gone: the error seen
    first, the exit just after, within the grace, must still name it."""
    exiting = subprocess.Popen(["sleep", "0.3"])
    try:
        assert lost_peers(RuntimeError(GLOO_CLOSED), rank_info(0, {1: exiting.pid, 2: os.getpid()})) == {1: DIED}
    finally:
        exiting.wait()


def test_a_transport_error_names_its_peer_and_whether_it_went_silent(peer_process):
    ranks = rank_info(0, {1: os.getpid(), 2: peer_process.pid})  # rank 1 runs on
    assert lost_peers(TransportError("... timed out ...", peer=2, timed_out=True), ranks) == {2: SILENT}
    assert lost_peers(TransportError("... failed ...", peer=2), ranks) == {2: DISCONNECTED}
    peer_process.send_signal(signal.SIGSTOP)
    time.sleep(0.2)
    assert lost_peers(TransportError("... timed out ...", peer=2, timed_out=True), ranks) == {2: STOPPED}
    assert lost_peers(Terminated({2: DIED}), ranks) == {2: DIED}
    # a drafter exited after losing the other one, and the target saw its transfer fail first
    after = rank_info(2, {0: 0x7FFFFFF0, 1: 0x7FFFFFF1})
    assert lost_peers(TransportError("... failed ...", peer=0), after) == {0: DIED, 1: DIED}
    assert lost_peers(Terminated({}), ranks) is None  # a SIGTERM with every peer running: a plain stop
    try:  # a SIGTERM that arrives while the failed transfer is being taken in
        try:
            raise TransportError("... failed ...", peer=2)
        except TransportError:
            raise Terminated({})
    except Terminated as terminated:
        assert lost_peers(terminated, ranks) == {2: STOPPED}


def test_the_line_names_this_rank_its_step_the_lost_rank_and_its_log(tmp_path):
    ranks = rank_info(0, {1: os.getpid(), 2: 0x7FFFFFF1})
    err = TransportError("rank 0 (drafter), step 5: the response failed", peer=2)
    err.__cause__ = RuntimeError(GLOO_CLOSED)
    line = str(peer_lost(err, ranks, SPLIT, 5, tmp_path))
    assert line == (f"rank 0 (drafter) at step 5: target rank 2 died or exited (its log: the lines tagged [rank2] in "
                    f"the launcher's output, its progress: {tmp_path / 'target_metrics' / 'rank2.jsonl'}) "
                    "[Connection closed by peer [127.0.0.1]:5820]")
    timeout = TransportError("rank 0 (drafter), step 5: timed out after 20 s waiting for the response [peer: target "
                             "rank 2]. Check that rank 2 is alive", peer=2, timed_out=True)
    assert str(peer_lost(timeout, rank_info(0, {}), SPLIT, 5, tmp_path)).endswith(
        "target rank 2 stopped answering (for --transport-timeout-s) (its log: the lines tagged [rank2] in the "
        f"launcher's output, its progress: {tmp_path / 'target_metrics' / 'rank2.jsonl'}) "
        "[step 5: timed out after 20 s waiting for the response]")
    # a stopped rank is named first: the ranks that waited on it exit, and look gone too
    both = str(peer_lost(Terminated({1: DIED, 2: STOPPED}), ranks, SPLIT, 5, Path("run")))
    assert both.index("target rank 2 is stopped") < both.index("drafter rank 1 died or exited")
    assert both.endswith("[SIGTERM: a launcher stops every rank once one has failed]")
    unknown = str(peer_lost(RuntimeError(GLOO_CLOSED), rank_info(1, {}), None, None, tmp_path))
    assert unknown.startswith("rank 1 during set-up: a peer rank is gone or silent")


SINGLE_PROCESS_INIT = """
import socket, sys
import dflash.placement.distributed as distributed
taken = socket.socket()
taken.bind(("127.0.0.1", 0))
taken.listen()
port = taken.getsockname()[1]
distributed._free_port = lambda: port  # another process took the port this one found free
info = distributed.init_distributed("cpu", timeout_minutes=1)
import torch.distributed as dist
t = __import__("torch").ones(1)
dist.all_reduce(t)
print("ok", info.rank, info.world_size, float(t))
distributed.shutdown()
"""


def test_a_process_started_without_a_launcher_needs_no_free_port():
    """Alone, the process group's store is in memory: a port taken between the moment it was
    found free and the group's start (a test's other runs, another job) does not stop the run."""
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT",
                                                                "MASTER_ADDR")}
    proc = subprocess.run([sys.executable, "-c", SINGLE_PROCESS_INIT], capture_output=True, text=True, timeout=300,
                          env={**env, "DS_ACCELERATOR": "cpu"}, cwd=Path(__file__).resolve().parents[3])
    assert proc.returncode == 0 and "ok 0 1 1.0" in proc.stdout, proc.stderr[-2000:]
