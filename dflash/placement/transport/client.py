"""The drafter rank's side of the transport: request micro-batches ahead of use, hand their
features back in the drafter's own step order.

Flow control: a drafter holds at most 2 x credits x targets submitted steps and keeps at most
`credits` requests in flight per target; a credit returns once a response has fully arrived.
Responses are consumed in step order whichever target computed them, so the data order is
deterministic. Routing (which target) is dflash.placement.transport.routing's pure rule; a step whose
best target has no free credit waits here and is routed again, with fresher estimates, at every
call of the client (receive() keeps calling while it waits).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from dflash.placement.transport.link import Op, PairGroups, POLL_S, Watchdog, check_hello, close_links, open_links
from dflash.placement.transport.routing import RouteView, pick_target
from dflash.placement.transport.wire import (FeatureBatch, REQUEST, RESPONSE_HEADER_LEN, STATUS_OK, STOP,
                                             TransportError, TransportSpec, WARMUP_BYTES, split_payload)

SPEED_SMOOTHING = 0.3  # weight of the newest service-time sample


@dataclass
class _Request:
    step: int
    sample_ids: list[int]
    shape: tuple[int, int]  # (b, S)
    target: int = -1  # the rest is set once the request is sent
    sends: list[Op] = field(default_factory=list)
    header: Op | None = None
    payload: Op | None = None
    arrived: bool = False

    @property
    def tokens(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def sent(self) -> bool:
        return self.header is not None

    def complete(self) -> bool:
        return self.header.done() and self.payload.done()


class DrafterClient:
    """Per training step: submit() the sampler's next micro-batches while free_credit() > 0,
    then receive() the step to train on. At the end stop() (returns at once), then close()."""

    def __init__(self, rank: int, target_ranks: list[int], spec: TransportSpec, lengths: np.ndarray,
                 groups: PairGroups, node_of: dict[int, int] | None = None) -> None:
        self.rank, self.spec, self.targets = rank, spec, sorted(target_ranks)
        self.lengths = np.asarray(lengths)
        node_of = node_of or {}
        self._links = open_links(rank, "drafter", self.targets, groups, spec.device)
        self._held: OrderedDict[int, _Request] = OrderedDict()  # submitted, not yet received
        self._waiting: deque[_Request] = deque()  # submitted, not sent yet: routed when sent
        self._route = RouteView(spec.credits, {t: 0 for t in self.targets}, {t: 0 for t in self.targets},
                                same_node={t: node_of.get(t) == node_of.get(rank) for t in self.targets})
        self._window = 2 * spec.credits * len(self.targets)
        self._closed = self._stopped = self._failed = False
        self._stops: dict[int, Op] = {}  # the STOP sent to each target
        try:
            self._handshake()
        except TransportError:
            close_links(self._links, clean=False)
            raise
        self._watchdog = Watchdog(rank, "drafter", self._links, spec.timeout_s, spec.watchdog_grace_s)

    def free_credit(self) -> int:
        """How many more steps may be submitted now."""
        self._guarded(self._progress)
        return self._window - len(self._held)

    def queue_depths(self) -> dict[int, int]:
        """Requests in flight per target rank (sent, response not fully arrived); at most credits."""
        self._guarded(self._progress)
        return dict(self._route.in_flight)

    def submit(self, step: int, sample_ids: list[int]) -> int | None:
        """Route one micro-batch and send it; returns the target, or None when the request
        waits here for a free credit (it is then sent at a later call)."""
        if self._stopped or self._closed or step in self._held or not sample_ids:
            raise ValueError(f"cannot submit step {step}: client stopped, step pending, or no sample ids")
        if self.free_credit() == 0:
            raise TransportError(f"rank {self.rank} (drafter), step {step}: no free credit "
                                 f"({len(self._held)} steps held, in flight per target {self._route.in_flight}); "
                                 "receive() the oldest step before submitting more")
        length = int(self.lengths[np.asarray(sample_ids)].max())
        req = _Request(step, list(sample_ids), (len(sample_ids), length))
        self._held[step] = req
        self._waiting.append(req)
        self._guarded(self._progress)
        return req.target if req.sent else None

    def receive(self, step: int) -> FeatureBatch:
        """Wait for the response of `step`, the oldest submitted step, and validate it."""
        oldest = next(iter(self._held), None)
        if step != oldest:
            raise ValueError(f"receive({step}): responses are consumed in submission order; "
                             f"the oldest pending step is {oldest}")
        return self._guarded(self._take, self._held.pop(step))

    def stop(self) -> None:
        """Tell every target that no request follows: STOP goes out behind the requests sent, which
        are still answered, and the ones not sent are dropped. Nothing here waits on a target, so the
        drafter's last work (its final checkpoint, the export) does not depend on them."""
        if self._stopped or self._failed:
            return
        self._stopped = True
        self._waiting.clear()  # never sent: nothing to drain
        for req in [req for req in self._held.values() if not req.sent]:
            del self._held[req.step]
        self._stops = self._guarded(lambda: {target: link.send_ints([STOP, -1, 0, 0], "close", "STOP")
                                             for target, link in self._links.items()})

    def close(self) -> None:
        """stop(), then wait until the requests in flight are answered and every STOP has gone out.
        After a TransportError nothing is sent: peers are gone or out of step; tear the group down."""
        if self._closed:
            return
        self._closed = True
        self._watchdog.disarm()
        try:
            if not self._failed:
                self.stop()
                self._drain()
        except TransportError:
            self._failed = True
            raise
        finally:
            close_links(self._links, clean=not self._failed)

    def _guarded(self, fn: Callable, *args):
        try:
            return fn(*args)
        except TransportError:
            self._failed = True
            self._watchdog.disarm()
            raise

    def _handshake(self) -> None:
        """Hello on the control channel, then one small payload that sets up the data channel
        (NCCL creates a communicator at its first transfer). Pairs are visited in (drafter,
        target) order on every rank, so the handshakes cannot wait on each other in a cycle."""
        deadline = time.monotonic() + self.spec.timeout_s
        for target, link in sorted(self._links.items()):
            sent = link.send_ints(self.spec.hello(), "set-up", "the hello")
            theirs = link.read_ints(link.recv_ints(len(self.spec.hello()), "set-up", "the hello"),
                                    deadline, self.spec.timeout_s, "set-up", "the hello")
            link.wait([sent], deadline, self.spec.timeout_s, "set-up", "the hello")
            check_hello(link, self.spec.hello(), theirs)
            warmup = link.recv_payload(WARMUP_BYTES, "set-up")
            link.wait([warmup], deadline, self.spec.timeout_s, "set-up", "the first payload")

    def _progress(self) -> None:
        """Return the credits of fully arrived responses, then send waiting requests, oldest
        first, while the target each is best routed to has a free credit."""
        for req in self._held.values():
            if req.sent and not req.arrived and req.complete():
                self._arrived(req)
        while self._waiting and (target := pick_target(self._route, self._waiting[0].tokens)) is not None:
            self._send(self._waiting.popleft(), target)

    def _send(self, req: _Request, target: int) -> None:
        """Post the receives for the response first, then send the request: the target's
        payload send then always finds its receive posted."""
        req.target = target
        link, where = self._links[target], f"step {req.step}"
        req.payload = link.recv_payload(self.spec.payload_nbytes(*req.shape), where)
        req.header = link.recv_ints(RESPONSE_HEADER_LEN, where, "the response header")
        req.sends = [link.send_ints([REQUEST, req.step, *req.shape], where, "the request"),
                     link.send_ints(req.sample_ids, where, "the request")]
        self._route.in_flight[target] += 1
        self._route.tokens_in_flight[target] += req.tokens

    def _arrived(self, req: _Request) -> None:
        req.arrived = True
        self._route.in_flight[req.target] -= 1
        self._route.tokens_in_flight[req.target] -= req.tokens

    def _take(self, req: _Request) -> FeatureBatch:
        timeout, where = self.spec.timeout_s, f"step {req.step}"
        deadline = time.monotonic() + timeout
        while not req.sent:
            if time.monotonic() > deadline:
                raise TransportError(f"rank {self.rank} (drafter), {where}: timed out after {timeout:g} s "
                                     f"waiting for a free credit (in flight per target {self._route.in_flight}). "
                                     "Check the targets' logs: they stopped answering.", timed_out=True)
            self._progress()
            time.sleep(POLL_S)
        link = self._links[req.target]
        link.wait(req.sends, deadline, timeout, where, "the request", self._progress)
        got_step, status, b, length, backlog, service_us = link.read_ints(
            req.header, deadline, timeout, where, "the response")
        if (got_step, status, (b, length)) != (req.step, STATUS_OK, req.shape):
            raise link.error(where, f"bad response header (step {got_step}, status {status}, shape "
                             f"{(b, length)}; expected step {req.step}, shape {req.shape})",
                             "Check that both sides read the same dataset (lengths), and the target's log.")
        link.wait([req.payload], deadline, timeout, where, "the response payload", self._progress)
        if not req.arrived:
            self._arrived(req)
        self._learn_speed(req, backlog, service_us)
        input_ids, features, *rest, mask = split_payload(link.hand_over(req.payload),
                                                         self.spec.payload_parts(*req.shape))
        return FeatureBatch(input_ids, mask.bool(), features, rest[0] if rest else None, target_rank=req.target)

    def _learn_speed(self, req: _Request, backlog: int, service_us: int) -> None:
        self._route.backlog[req.target] = backlog
        if service_us <= 0:  # the target has not timed a request yet
            return
        sample = service_us * 1e-6 / req.tokens
        old = self._route.sec_per_token.get(req.target, sample)
        self._route.sec_per_token[req.target] = (1 - SPEED_SMOOTHING) * old + SPEED_SMOOTHING * sample

    def _drain(self) -> None:
        deadline = time.monotonic() + self.spec.timeout_s
        for req in self._held.values():  # drained, so no transfer is cut off at teardown
            self._links[req.target].wait([*req.sends, req.header, req.payload], deadline, self.spec.timeout_s,
                                         f"step {req.step}", "the response")
        self._held.clear()
        for target, op in self._stops.items():
            self._links[target].wait([op], deadline, self.spec.timeout_s, "close", "STOP")
