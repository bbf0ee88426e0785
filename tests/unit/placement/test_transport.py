"""Split-placement transport over gloo, one process per rank: exact delivery in the drafter's step
order, credit-based routing between targets of different speeds, and bounded failure when a peer
dies, hangs or disagrees."""

from __future__ import annotations

import logging
import os
import queue
import socket
import time
from collections import Counter
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash.placement.transport import (DrafterClient, FeatureBatch, TargetServer, TransportError, TransportSpec,
                                        open_pair_groups)

NUM_SAMPLES, HIDDEN, NUM_FEATURE_LAYERS = 64, 8, 3
LENGTHS = np.random.default_rng(0).integers(3, 40, size=NUM_SAMPLES)


@dataclass(frozen=True)
class Layout:
    targets: int
    drafters: int
    with_final_hidden: bool = True
    credits: int = 4
    timeout_s: float = 10.0
    steps: int = 30
    uniform: bool = False  # equal-sized micro-batches, as token-budget batching makes them
    dtype: torch.dtype = torch.float32

    @property
    def lengths(self) -> np.ndarray:
        return np.full(NUM_SAMPLES, 16) if self.uniform else LENGTHS

    def sample_ids(self, rank: int, step: int) -> list[int]:
        """A drafter's micro-batch, different on every rank and step: 2 samples, or 1 to 4."""
        size = 2 if self.uniform else 1 + step % 4
        return [(rank * 17 + step * 5 + j) % NUM_SAMPLES for j in range(size)]

    @property
    def target_ranks(self) -> list[int]:
        return list(range(self.targets))

    @property
    def drafter_ranks(self) -> list[int]:
        return list(range(self.targets, self.targets + self.drafters))

    def spec(self) -> TransportSpec:
        return TransportSpec(HIDDEN * NUM_FEATURE_LAYERS, HIDDEN, self.with_final_hidden, self.dtype,
                             torch.device("cpu"), self.credits, self.timeout_s)


def fake_compute(ids: list[int], with_final_hidden: bool, lengths: np.ndarray = LENGTHS) -> FeatureBatch:
    """Deterministic stand-in for the target forward: every value encodes (sample, position, channel)."""
    lens = torch.as_tensor(lengths[ids])
    pos = torch.arange(int(lens.max()))
    valid = pos[None, :] < lens[:, None]
    input_ids = torch.where(valid, torch.tensor(ids)[:, None] * 1000 + pos, 0)
    loss_mask = valid & (pos % 3 != 0)
    base = input_ids[..., None].float()
    features = base + torch.arange(HIDDEN * NUM_FEATURE_LAYERS) / 32
    final_hidden = -base - torch.arange(HIDDEN) / 32 if with_final_hidden else None
    return FeatureBatch(input_ids, loss_mask, features, final_hidden)


def assert_batch_matches(batch: FeatureBatch, ids: list[int], layout: Layout) -> None:
    want = fake_compute(ids, layout.with_final_hidden, layout.lengths)
    assert torch.equal(batch.input_ids, want.input_ids)
    assert batch.loss_mask.dtype == torch.bool and torch.equal(batch.loss_mask, want.loss_mask)
    assert torch.equal(batch.features, want.features.to(layout.dtype))
    assert (batch.final_hidden is None) == (want.final_hidden is None)
    if want.final_hidden is not None:
        assert torch.equal(batch.final_hidden, want.final_hidden.to(layout.dtype))


# ---------------------------------------------------------------- process harness

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, role: Callable, args: tuple, results: Any) -> None:
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        results.put((rank, "ok", role(rank, *args)))
    except Exception as exc:
        results.put((rank, type(exc).__name__, str(exc)))
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, role: Callable, *args: Any, limit_s: float = 20.0,
              needed: set[int] | None = None) -> dict[int, tuple[str, Any]]:
    """Run role(rank, *args) on `world` gloo ranks; returns rank -> (outcome, value) for the ranks
    that reported (a rank that died reports nothing). Once the `needed` ranks (default: all) have
    reported, the others get a second to finish; stragglers are killed."""
    needed = set(range(world)) if needed is None else needed
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, role, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + limit_s
    while not needed <= out.keys() and time.monotonic() < deadline:
        try:
            rank, outcome, value = results.get(timeout=0.2)
            out[rank] = (outcome, value)
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                break
    deadline = min(deadline, time.monotonic() + 1.0)
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    return out


# ---------------------------------------------------------------- roles

def drafter_loop(client: DrafterClient, rank: int, layout: Layout, steps: int) -> dict[str, Any]:
    """Submit while there is credit, consume in step order; check every batch."""
    submitted, depths, served_by = 0, [], Counter()
    for step in range(steps):
        while submitted < steps and client.free_credit() > 0:
            client.submit(submitted, layout.sample_ids(rank, submitted))
            submitted += 1
        depths.append(client.queue_depths())
        batch = client.receive(step)
        assert_batch_matches(batch, layout.sample_ids(rank, step), layout)
        served_by[batch.target_rank] += 1
    client.close()
    return {"served_by": dict(served_by), "depths": depths}


def layout_role(rank: int, layout: Layout, target_delay: dict[int, float] | None = None) -> Any:
    groups = open_pair_groups(layout.drafter_ranks, layout.target_ranks)
    spec = layout.spec()
    if rank in layout.target_ranks:
        delay = (target_delay or {}).get(rank, 0.0)

        def compute(ids: list[int]):  # takes `delay` seconds in all
            done_at = time.monotonic() + delay
            out = fake_compute(ids, layout.with_final_hidden, layout.lengths)
            time.sleep(max(0.0, done_at - time.monotonic()))
            return out

        stats = TargetServer(rank, layout.drafter_ranks, spec, compute, groups).serve()
        return {"requests": stats.requests, "bytes": stats.bytes_sent, "busy": stats.busy_s}
    client = DrafterClient(rank, layout.target_ranks, spec, layout.lengths, groups)
    return drafter_loop(client, rank, layout, layout.steps)


def failing_role(rank: int, layout: Layout, failure: str) -> Any:
    """Rank 0 serves, rank 1 drafts; `failure` names which side dies or hangs at its 5th request."""
    spec, groups = layout.spec(), open_pair_groups([1], [0])
    if rank == 0:
        served = []

        def compute(ids: list[int]):
            served.append(ids)
            if len(served) == 5 and failure == "target dies":
                os._exit(3)
            if len(served) == 5 and failure == "target hangs":
                time.sleep(120)
            return fake_compute(ids, layout.with_final_hidden)

        server = TargetServer(0, [1], spec, compute, groups)
        started = time.monotonic()
        try:
            server.serve()
        except TransportError as exc:
            raise TransportError(f"{exc} [after {time.monotonic() - started:.1f} s]") from exc
        return "served"
    client = DrafterClient(1, [0], spec, LENGTHS, groups)
    for step in range(spec.credits):
        client.submit(step, layout.sample_ids(1, step))
    for step in range(2):
        client.receive(step)
        client.submit(step + spec.credits, layout.sample_ids(1, step + spec.credits))
    if failure == "drafter dies":
        os._exit(3)
    if failure == "drafter hangs":
        time.sleep(120)
    started = time.monotonic()
    try:
        for step in range(2, 8):
            client.receive(step)
            client.submit(step + spec.credits, layout.sample_ids(1, step + spec.credits))
    except TransportError as exc:
        raise TransportError(f"{exc} [after {time.monotonic() - started:.1f} s]") from exc
    client.close()
    return "done"


def mismatch_role(rank: int, layout: Layout, what: str) -> Any:
    spec, groups = layout.spec(), open_pair_groups([1], [0])
    if rank == 0:
        if what == "spec":
            spec = replace(spec, credits=spec.credits + 1)
        return TargetServer(0, [1], spec, lambda ids: fake_compute(ids, layout.with_final_hidden), groups).serve()
    lengths = LENGTHS + 1 if what == "lengths" else LENGTHS  # the drafter expects longer samples
    client = DrafterClient(1, [0], spec, lengths, groups)
    client.submit(0, layout.sample_ids(1, 0))
    return client.receive(0)


def stuck_drafter_role(rank: int, layout: Layout) -> Any:
    """Rank 0 serves one request and dies on the next; rank 1's main thread then never comes back to the
    transport, as when a CUDA call waits forever on a transfer from the dead peer."""
    spec, groups = replace(layout.spec(), watchdog_grace_s=2.0), open_pair_groups([1], [0])
    if rank == 0:
        served = []

        def compute(ids: list[int]):
            served.append(ids)
            if len(served) == 2:
                os._exit(3)
            return fake_compute(ids, layout.with_final_hidden)

        return TargetServer(0, [1], spec, compute, groups).serve()
    client = DrafterClient(1, [0], spec, LENGTHS, groups)
    for step in range(spec.credits):
        client.submit(step, layout.sample_ids(1, step))
    client.receive(0)
    client.free_credit()  # routes and sends the steps held back until the target's speed was known
    time.sleep(60)
    return "the watchdog did not end this rank"


# ---------------------------------------------------------------- tests

def seconds_to_fail(message: str) -> float:
    return float(message.rsplit("[after ", 1)[1].rstrip(" s]"))


LAYOUTS = [Layout(1, 1, with_final_hidden=True), Layout(1, 1, with_final_hidden=False),
           Layout(2, 1, with_final_hidden=True, dtype=torch.bfloat16), Layout(1, 2, with_final_hidden=False)]


def layout_id(layout: Layout) -> str:
    dtype = str(layout.dtype).removeprefix("torch.")
    return f"{layout.targets}t{layout.drafters}d-kd{int(layout.with_final_hidden)}-{dtype}"


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_drafters_receive_what_compute_produced_in_step_order(layout):
    results = run_ranks(layout.targets + layout.drafters, layout_role, layout)
    assert all(outcome == "ok" for outcome, _ in results.values()), results
    served = Counter()
    for rank in layout.target_ranks:
        served.update(results[rank][1]["requests"])
        assert results[rank][1]["bytes"] > 0
    for rank in layout.drafter_ranks:
        report = results[rank][1]
        assert served[rank] == layout.steps
        assert sum(report["served_by"].values()) == layout.steps
        if layout.targets == 2:
            assert set(report["served_by"]) == {0, 1}


def test_a_slow_target_gets_fewer_micro_batches_and_no_queue_exceeds_its_credit():
    """The routing rule's throughput is checked on a simulated clock (test_routing.py); here the
    real transport must apply it: counts and queue depths only, no wall-clock rates."""
    layout = Layout(2, 1, with_final_hidden=False, steps=60, uniform=True)
    results = run_ranks(3, layout_role, layout, {0: 0.080, 1: 0.020}, limit_s=60.0)
    assert all(outcome == "ok" for outcome, _ in results.values()), results
    report = results[2][1]
    assert report["served_by"][0] < report["served_by"][1] / 2, report["served_by"]
    assert max(max(d.values()) for d in report["depths"]) <= layout.credits


@pytest.mark.parametrize("failure", ["target dies", "target hangs"])
def test_drafter_raises_when_its_target_fails(failure):
    layout = Layout(1, 1, timeout_s=3.0)
    results = run_ranks(2, failing_role, layout, failure, limit_s=15.0, needed={1})
    outcome, message = results[1]
    assert outcome == "TransportError", results
    assert "rank 1 (drafter), step 4" in message and "target rank 0" in message
    assert seconds_to_fail(message) <= layout.timeout_s + 1.0
    if failure == "target hangs":
        assert "timed out after 3 s waiting for the response" in message
    else:
        assert "crashed" in message


@pytest.mark.parametrize("failure", ["drafter dies", "drafter hangs"])
def test_target_raises_when_a_drafter_fails(failure):
    layout = Layout(1, 1, timeout_s=3.0)
    results = run_ranks(2, failing_role, layout, failure, limit_s=15.0, needed={0})
    outcome, message = results[0]
    assert outcome == "TransportError", results
    assert seconds_to_fail(message) <= layout.timeout_s + 1.0
    if failure == "drafter hangs":
        assert "rank 0 (target): no request or STOP from drafter ranks [1] for 3 s" in message
    else:
        assert "rank 0 (target)" in message and "drafter rank 1" in message and "crashed" in message


@pytest.mark.parametrize("what", ["spec", "lengths"])
def test_disagreeing_sides_fail_on_both_with_a_clear_message(what):
    results = run_ranks(2, mismatch_role, Layout(1, 1, timeout_s=3.0), what, limit_s=15.0)
    assert results[0][0] == results[1][0] == "TransportError", results
    if what == "spec":
        assert "differs" in results[0][1] and "differs" in results[1][1]
    else:
        assert "compute() returned input_ids" in results[0][1]
        assert "bad response header" in results[1][1] and "status 1" in results[1][1]


def test_watchdog_ends_a_rank_whose_main_thread_is_stuck_after_its_peer_died(capfd):
    started = time.monotonic()
    results = run_ranks(2, stuck_drafter_role, Layout(1, 1, timeout_s=3.0), limit_s=30.0, needed={1})
    assert results == {}, results  # neither rank returned: the target died, the drafter was ended
    assert time.monotonic() - started < 25
    err = capfd.readouterr().err
    assert "TransportError: rank 1 (drafter): a transfer with target rank 0 failed" in err, err[-3000:]
    assert "main thread has not returned to notice it in 2 s" in err
