"""The target rank's side of the transport: serve drafter requests with the frozen target.

A target keeps a request-header receive posted (on gloo) for every live drafter, serves
requests in the order it sees them complete, sends each payload on the data channel and then
its header, and keeps at most `credits` responses in flight per drafter. It raises when no live
drafter sent anything for timeout_s, so a drafter that pauses longer (a slow checkpoint) needs a
larger --transport-timeout-s.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from dflash.placement.transport.link import Op, PairGroups, POLL_S, Watchdog, check_hello, close_links, open_links
from dflash.placement.transport.wire import (FeatureBatch, REQUEST, REQUEST_HEADER_LEN, STATUS_BAD_SHAPE, STATUS_OK,
                                             STOP, TransportError, TransportSpec, WARMUP_BYTES, join_payload)

logger = logging.getLogger(__name__)



@dataclass
class ServeStats:
    requests: dict[int, int]  # served per drafter rank
    busy_s: float = 0.0  # receiving ids, computing (on CUDA: queuing the compute), posting responses
    idle_s: float = 0.0  # waiting with nothing to serve
    forward_s: float = 0.0  # the target's forward over the finished requests (GPU time on CUDA)
    bytes_sent: int = 0
    responses_sent: int = 0  # responses whose transfer finished (the rest are still in flight)
    started: float = field(default_factory=time.monotonic)

    def record(self, step: int, queued: int) -> dict:
        """The time split so far, as fractions of the wall time since serving started."""
        wall = max(time.monotonic() - self.started, 1e-9)
        return {"step": step, "requests": sum(self.requests.values()), "wall_s": round(wall, 3),
                "forward_fraction": round(self.forward_s / wall, 4), "serving_fraction": round(self.busy_s / wall, 4),
                "idle_fraction": round(self.idle_s / wall, 4), "queued": queued, "responses_sent": self.responses_sent,
                "mb_sent": round(self.bytes_sent / 1e6, 3)}


class _ServiceClock:
    """How long the last finished request took to compute. On CUDA the forward runs
    asynchronously, so it is timed with events and read once they have completed."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._open: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._last_s = 0.0
        self._total_s = 0.0

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        if not self._cuda:
            started = time.perf_counter()
            yield
            self._last_s = time.perf_counter() - started
            self._total_s += self._last_s
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._open.append((start, end))

    def last_us(self) -> int:
        self._collect()
        return round(self._last_s * 1e6)

    def total_s(self) -> float:
        """The compute time of every request finished so far."""
        self._collect()
        return self._total_s

    def _collect(self) -> None:
        while self._open and self._open[0][1].query():
            start, end = self._open.popleft()
            self._last_s = start.elapsed_time(end) / 1e3
            self._total_s += self._last_s


@dataclass
class _Arrival:
    drafter: int
    step: int
    shape: tuple[int, int]  # (b, S) the drafter expects
    ids: Op


@dataclass
class _ServeState:
    headers: dict[int, Op]  # the posted header receive per live drafter
    arrivals: deque[_Arrival] = field(default_factory=deque)  # FIFO in the order seen complete
    sends: dict[int, deque[tuple[int, list[Op]]]] = field(default_factory=dict)  # (step, [payload, header])
    live: set[int] = field(default_factory=set)  # drafters that have not sent STOP
    last_step: dict[int, int] = field(default_factory=dict)

    def backlog(self, drafter: int) -> int:
        """Tokens queued here by the other drafters."""
        return sum(a.shape[0] * a.shape[1] for a in self.arrivals if a.drafter != drafter)


class TargetServer:
    """Serves drafter requests: compute(sample_ids) -> FeatureBatch, S the longest of those samples."""

    def __init__(self, rank: int, drafter_ranks: list[int], spec: TransportSpec,
                 compute: Callable[[list[int]], FeatureBatch], groups: PairGroups,
                 on_served: Callable[[dict], None] | None = None) -> None:
        """`on_served` gets ServeStats.record() after each request (the step it was for, the time
        split so far): the run logs a target's own progress with it."""
        self.rank, self.spec, self.compute, self.drafters = rank, spec, compute, sorted(drafter_ranks)
        self.on_served = on_served
        self._links = open_links(rank, "target", self.drafters, groups, spec.device)
        self._clock = _ServiceClock(spec.device)
        try:
            self._handshake()
        except TransportError:
            close_links(self._links, clean=False)
            raise

    def serve(self) -> ServeStats:
        """Serve until every drafter sent STOP. Raises TransportError when no live drafter sends
        anything for timeout_s, or when a transfer fails."""
        stats = ServeStats({d: 0 for d in self.drafters})
        state = _ServeState({d: self._post_header(d, "the first request") for d in self.drafters},
                            sends={d: deque() for d in self.drafters}, live=set(self.drafters))
        last_seen, clean = time.monotonic(), False
        watchdog = Watchdog(self.rank, "target", self._links, self.spec.timeout_s, self.spec.watchdog_grace_s)
        try:
            while state.live or state.arrivals:
                if self._collect(state):
                    last_seen = time.monotonic()
                self._reap(state, stats, wait=False)
                now = time.monotonic()
                if state.arrivals:
                    arrival = state.arrivals.popleft()
                    self._serve_one(arrival, state, stats)
                    last_seen = time.monotonic()
                    stats.busy_s += last_seen - now
                    if self.on_served is not None:
                        stats.forward_s = self._clock.total_s()
                        self.on_served(stats.record(arrival.step, len(state.arrivals)))
                elif now - last_seen > self.spec.timeout_s:
                    raise TransportError(
                        f"rank {self.rank} (target): no request or STOP from drafter ranks "
                        f"{sorted(state.live)} for {self.spec.timeout_s:g} s (last step seen from each: "
                        f"{state.last_step}). Check those ranks' logs: a drafter that died, hung, "
                        "or paused longer than --transport-timeout-s leaves its targets waiting.",
                        peer=min(state.live) if len(state.live) == 1 else None, timed_out=True)
                else:
                    time.sleep(POLL_S)
                    stats.idle_s += time.monotonic() - now
            self._reap(state, stats, wait=True)
            stats.forward_s = self._clock.total_s()
            clean = True
        finally:
            watchdog.disarm()
            close_links(self._links, clean)
        logger.info("target rank %d served %s requests, forward %.1f s, serving %.1f s, idle %.1f s, %.1f MB sent",
                    self.rank, stats.requests, stats.forward_s, stats.busy_s, stats.idle_s, stats.bytes_sent / 1e6)
        return stats

    def _handshake(self) -> None:
        """The drafter's handshake, mirrored (see DrafterClient._handshake)."""
        deadline = time.monotonic() + self.spec.timeout_s
        for drafter, link in sorted(self._links.items()):
            hello = link.recv_ints(len(self.spec.hello()), "set-up", "the hello")
            theirs = link.read_ints(hello, deadline, self.spec.timeout_s, "set-up", "the hello")
            link.wait([link.send_ints(self.spec.hello(), "set-up", "the hello")],
                      deadline, self.spec.timeout_s, "set-up", "the hello")
            check_hello(link, self.spec.hello(), theirs)
            warmup = link.send_payload(torch.zeros(WARMUP_BYTES, dtype=torch.uint8, device=self.spec.device), "set-up")
            link.wait([warmup], deadline, self.spec.timeout_s, "set-up", "the first payload")

    def _post_header(self, drafter: int, where: str) -> Op:
        return self._links[drafter].recv_ints(REQUEST_HEADER_LEN, where, "a request")

    def _collect(self, state: _ServeState) -> bool:
        """Queue every request whose header completed; returns whether any did."""
        seen = [d for d, op in state.headers.items() if op.done()]
        for drafter in seen:
            link, op = self._links[drafter], state.headers.pop(drafter)
            where = f"the request after step {state.last_step.get(drafter, 'none')}"
            # already complete: no wait, only its error (if any) surfaces
            kind, step, n, length = link.read_ints(op, time.monotonic(), 0.0, where, "a request")
            if kind == STOP:
                state.live.discard(drafter)
            elif kind == REQUEST:
                ids = link.recv_ints(n, f"step {step}", "the sample ids")
                state.arrivals.append(_Arrival(drafter, step, (n, length), ids))
                state.last_step[drafter] = step
                state.headers[drafter] = self._post_header(drafter, f"the request after step {step}")
            else:
                raise link.error(where, f"unknown request kind {kind}", "Both sides must run the same code.")
        return bool(seen)

    def _serve_one(self, arrival: _Arrival, state: _ServeState, stats: ServeStats) -> None:
        link, spec, where = self._links[arrival.drafter], self.spec, f"step {arrival.step}"
        deadline = time.monotonic() + spec.timeout_s
        ids = link.read_ints(arrival.ids, deadline, spec.timeout_s, where, "the sample ids")
        with self._clock.measure():
            tensors, problem = self._wire_tensors(self.compute(ids), arrival.shape)
        in_flight = state.sends[arrival.drafter]
        if len(in_flight) >= spec.credits:  # bound the responses in flight to this drafter
            self._retire(arrival.drafter, *in_flight.popleft(), stats, deadline)
        if problem:  # the drafter posted a receive of the full size: match it
            payload = torch.zeros(spec.payload_nbytes(*arrival.shape), dtype=torch.uint8, device=spec.device)
        else:
            payload = join_payload(tensors)
        ops = [link.send_payload(payload, where)]
        ops.append(link.send_ints([arrival.step, STATUS_BAD_SHAPE if problem else STATUS_OK, *arrival.shape,
                                   state.backlog(arrival.drafter), self._clock.last_us()], where, "the response"))
        in_flight.append((arrival.step, ops))
        stats.requests[arrival.drafter] += 1
        if problem:
            raise link.error(where, f"compute() returned {problem}",
                             "Check that both sides read the same dataset (lengths).")

    def _wire_tensors(self, batch: FeatureBatch, shape: tuple[int, int]) -> tuple[list[torch.Tensor], str]:
        """The payload tensors in wire order and dtypes, or what does not fit the request."""
        spec = self.spec
        input_ids, loss_mask, features, final_hidden = batch.input_ids, batch.loss_mask, batch.features, batch.final_hidden
        expected = {"input_ids": (input_ids, shape), "loss_mask": (loss_mask, shape),
                    "features": (features, (*shape, spec.feature_dim))}
        if spec.with_final_hidden:
            expected["final_hidden"] = (final_hidden, (*shape, spec.hidden_dim))
        problems = [f"{name} {None if t is None else tuple(t.shape)} (expected {want})"
                    for name, (t, want) in expected.items() if t is None or tuple(t.shape) != want]
        if final_hidden is not None and not spec.with_final_hidden:
            problems.append("final_hidden although distillation is off")
        if problems:
            return [], ", ".join(problems)
        out = [input_ids.to(spec.device, torch.int64), features.to(spec.device, spec.feature_dtype)]
        if spec.with_final_hidden:
            out.append(final_hidden.to(spec.device, spec.feature_dtype))
        return [*out, loss_mask.to(spec.device, torch.uint8)], ""

    def _reap(self, state: _ServeState, stats: ServeStats, wait: bool) -> None:
        """Retire finished responses (all of them when `wait`)."""
        deadline = time.monotonic() + self.spec.timeout_s
        for drafter, in_flight in state.sends.items():
            while in_flight and (wait or all(op.done() for op in in_flight[0][1])):
                self._retire(drafter, *in_flight.popleft(), stats, deadline)

    def _retire(self, drafter: int, step: int, ops: list[Op], stats: ServeStats, deadline: float) -> None:
        self._links[drafter].wait(ops, deadline, self.spec.timeout_s, f"step {step}", "the response")
        stats.bytes_sent += ops[0].nbytes
        stats.responses_sent += 1
