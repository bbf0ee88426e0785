"""The final evaluation's waits are bounded: rank 0 names a planned rank that died at once, one
that fails with its error, one that stalls after the timeout, and waits on for one that is slow
but shows progress. A TCP store stands in for the launch's rendezvous store."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import dflash.eval.spread as spread
from dflash.eval.evaluate import EvalRequest, EvalTally, TeacherForcedTally
from dflash.placement.distributed import RankInfo, pid_space

REQUEST = EvalRequest("target", "target", "heldout.jsonl", num_prompts=4, max_new_tokens=8)
DRAFTERS = {"trained": "runs/x/drafter"}


@pytest.fixture
def store(monkeypatch):
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30))
    monkeypatch.setattr(spread, "rendezvous_store", lambda: store)
    monkeypatch.setattr(spread, "POLL_S", 0.01)
    return store


def rank0(processes: dict | None = None) -> RankInfo:
    return RankInfo(0, 2, 0, torch.device("cpu"), processes or {})


def tally(prompts: int, accepted: list[int]) -> EvalTally:
    return EvalTally("float32", "plain", TeacherForcedTally([0.0] * 4, [0.0] * 4), 4, prompts=prompts,
                     accepted=accepted, greedy_seconds=1.0, speculative_seconds=0.5, tokens=10 * prompts)


def test_a_planned_rank_that_died_is_named_at_once(store):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    started = time.monotonic()
    with pytest.raises(spread.FinalEvalError, match="rank 1 died before it could publish its final evaluation"):
        spread.judge_all(rank0({1: (pid_space(), dead.pid)}), [1], REQUEST, DRAFTERS, 0, timeout_s=60)
    assert time.monotonic() - started < 5


def test_a_planned_rank_that_failed_gives_rank_0_its_error(store):
    store.set(spread.KEY + "tally/1", json.dumps({"error": "OutOfMemoryError: CUDA out of memory"}))
    with pytest.raises(spread.FinalEvalError, match="rank 1 failed in the final evaluation: OutOfMemoryError"):
        spread.judge_all(rank0(), [1], REQUEST, DRAFTERS, 0, timeout_s=60)


def test_a_planned_rank_that_stalls_is_named_after_the_timeout(store):
    started = time.monotonic()
    with pytest.raises(spread.FinalEvalError, match=r"rank 1 did not publish its final evaluation within 0.5 s "
                                                     r"\(--dist-timeout-minutes\)"):
        spread.judge_all(rank0(), [1], REQUEST, DRAFTERS, 0, timeout_s=0.5)
    assert 0.5 <= time.monotonic() - started < 5


def test_a_slow_rank_that_shows_progress_is_waited_for_and_the_shares_add_up(store):
    """Two planned ranks, each slower than the timeout in all but counting a prompt more often."""
    def slow_rank(rank: int, share: EvalTally) -> None:
        for _ in range(6):
            time.sleep(0.1)
            store.add(spread.KEY + f"progress/{rank}", 1)
        store.set(spread.KEY + f"tally/{rank}", json.dumps({"trained": asdict(share)}))

    shares = {1: tally(2, [3, 1, 0]), 2: tally(2, [2])}
    workers = [threading.Thread(target=slow_rank, args=item) for item in shares.items()]
    for worker in workers:
        worker.start()
    reports = spread.judge_all(rank0(), [1, 2], REQUEST, DRAFTERS, 0, timeout_s=0.3)
    for worker in workers:
        worker.join()
    plan = json.loads(store.get(spread.KEY + "plan"))
    assert plan["ranks"] == [1, 2] and plan["request"] == asdict(REQUEST) and plan["drafters"] == DRAFTERS
    merged = reports["trained"]
    assert (merged.prompts, merged.tokens, merged.tau) == (4, 40, 1 + 6 / 4)
    assert merged.acceptance == [0.75, 0.5, 0.25]
