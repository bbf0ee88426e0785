"""dflash.util.ranks: a rank's place from the launcher's environment, its own GPU, and syncs whose
waits are bounded: rank 0 names a peer that died at once, and one that stalled after the timeout."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO, free_port, run_two_at_a_time
from dflash.util.cli import ConfigError
from dflash.util.ranks import Launch, launched, pin_local_gpu


def test_the_launchers_environment_gives_the_rank(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert launched() == Launch(0, 1, 0)  # plain python
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launched() == Launch(3, 4, 1) and not launched().is_main
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ConfigError, match="RANK=4, WORLD_SIZE=4"):
        launched()
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ConfigError, match="WORLD_SIZE='four' is not a number"):
        launched()


def test_each_rank_sees_its_own_gpu_alone(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    pin_local_gpu(2)  # torchrun: every GPU visible
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # deepspeed --include: the node's list
    pin_local_gpu(1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(ConfigError, match="LOCAL_RANK 2, but CUDA_VISIBLE_DEVICES=4,5 lists 2 GPUs"):
        pin_local_gpu(2)


def run_ranks(mode: str, world: int, timeout_s: float) -> tuple[list[str], float]:
    """Each rank's output and rank 0's wall time; rank 1 is ended once rank 0 is done."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}", "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "rank_group_worker.py"), mode, str(timeout_s)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    started = time.monotonic()
    out = [procs[0].communicate(timeout=120)[0]]
    seconds = time.monotonic() - started
    for proc in procs[1:]:
        if mode == "stall":
            proc.kill()
        out.append(proc.communicate(timeout=60)[0])
    return out, seconds


def test_rank_0_gets_every_report_and_the_peers_rank_0s_value():
    out, _ = run_ranks("finish", 3, 60)
    assert out[0].strip() == "hello from rank 0 [[0, 0], [1, 10], [2, 20]]"
    assert [line.strip() for line in out[1:]] == ["hello from rank 0 [[1, 10]]", "hello from rank 0 [[2, 20]]"]


def test_a_dead_peer_is_named_at_once_and_a_stalled_one_after_the_timeout():
    # the two groups go at once: each spends most of its time starting up, or waiting out the timeout
    runs = run_two_at_a_time({"die": functools.partial(run_ranks, "die", 3, 300),
                              "stall": functools.partial(run_ranks, "stall", 2, 4)})
    out, seconds = runs["die"]
    assert "PeerError naming rank 1: rank 0: rank 1 stopped before 'finishing'" in out[0], out
    assert "Traceback" not in out[0] and seconds < 100, seconds  # not the 300 s timeout
    out, seconds = runs["stall"]
    assert ("PeerError naming rank 1: rank 0: rank 1 did not reach 'finishing' within 4 s (--peer-timeout-s): "
            "it is stalled") in out[0], out
