"""Point-to-point feature transport for split placement: target ranks run the frozen target,
drafter ranks train on what they send back, one micro-batch per request.

Protocol (isend/irecv only: no tags, no receive-from-any-source, which NCCL lacks). Each
direction of a (drafter, target) pair is its own ordered channel; on NCCL it must be its own
communicator (open_pair_groups), since NCCL runs a communicator's operations on one stream in
posting order. Control messages are int64:
  hello     drafter -> target  [version, F, D, with_final_hidden, credits, dtype]; the target
                               answers with its own and both sides check they match
  request   drafter -> target  [REQUEST, step, n, S], then the n sample ids
  stop      drafter -> target  [STOP, -1, 0, 0]: nothing more comes from this drafter
  response  target -> drafter  one byte message whose size both sides know from (b, S): int64
                               header [step, status, b, S, backlog, service_us], input_ids
                               [b, S] int64, features [b, S, F], final_hidden [b, S, D] when
                               distillation is on, loss_mask [b, S] uint8; after a bad status
                               only zeros follow the header
backlog: tokens queued at that target by other drafters; service_us: how long the target's
last timed request took to compute.

Flow control. A drafter holds at most 2 x credits x targets submitted steps and keeps at most
`credits` requests in flight per target; a credit returns once a response has fully arrived.
Responses are consumed in the drafter's own step order, whichever target computed them, so the
data order is deterministic. A target keeps a header receive posted for every live drafter,
serves requests in the order it sees them complete, and keeps at most `credits` responses in
flight per drafter.

Routing. In-order consumption makes a plain most-free-credit rule stall: a slow target holding
as many requests as a fast one sets the pace. So a step goes to the target expected to finish
it first, (its tokens + tokens in flight there + backlog) x that target's measured seconds per
token; with equal speeds that is the target with the most free credit. Ties go to a target on
this node, then to the lowest rank; a target that has not reported its speed yet gets one
request at a time. When the chosen target has no free credit the step waits here and is routed
again, with fresher estimates, at every call of the client (receive() keeps calling while it
waits).

Timeouts. Every wait polls for completion against TransportSpec.timeout_s, the same way on gloo
and NCCL, and raises TransportError naming both ranks, the step and what to check. A target
also raises when no live drafter sent anything for timeout_s, so a drafter that pauses longer
(evaluation, a slow checkpoint) must close() first. Keep the process-group timeout above
timeout_s: a posted receive older than that trips NCCL's watchdog, or gloo's own timeout.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
REQUEST, STOP = 1, 2
STATUS_OK, STATUS_BAD_SHAPE = 0, 1
REQUEST_HEADER_LEN, RESPONSE_HEADER_LEN = 4, 6
FEATURE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
POLL_S = 2e-4
SPEED_SMOOTHING = 0.3  # weight of the newest service-time sample

Computed = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
Part = tuple[torch.dtype, tuple[int, ...]]
PairGroups = dict[tuple[int, int], tuple[dist.ProcessGroup, dist.ProcessGroup]]  # (requests, responses)


class TransportError(RuntimeError):
    """A peer timed out, died or broke the protocol. The message names both ranks and the step."""


@dataclass
class FeatureBatch:
    """One micro-batch as the drafter receives it."""

    step: int
    input_ids: torch.Tensor  # [b, S] int64, right padded
    loss_mask: torch.Tensor  # [b, S] bool
    features: torch.Tensor  # [b, S, F]
    final_hidden: torch.Tensor | None  # [b, S, D] when distillation is on
    target_rank: int


@dataclass
class TransportSpec:
    """Fixed for a run and identical on all ranks (checked at construction)."""

    feature_dim: int
    hidden_dim: int
    with_final_hidden: bool
    feature_dtype: torch.dtype  # of features and final_hidden on the wire
    device: torch.device  # cuda:local_rank for NCCL, cpu for gloo
    credits: int = 4
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.feature_dtype not in FEATURE_DTYPES:
            raise ValueError(f"feature_dtype {self.feature_dtype} is not one of {FEATURE_DTYPES}")
        if self.credits < 1 or self.timeout_s <= 0:
            raise ValueError(f"credits ({self.credits}) must be >= 1 and timeout_s ({self.timeout_s}) > 0")

    def hello(self) -> list[int]:
        return [PROTOCOL_VERSION, self.feature_dim, self.hidden_dim, int(self.with_final_hidden),
                self.credits, FEATURE_DTYPES.index(self.feature_dtype)]


@dataclass
class ServeStats:
    requests: dict[int, int]  # served per drafter rank
    busy_s: float = 0.0  # receiving ids, computing, posting responses
    idle_s: float = 0.0  # waiting with nothing to serve
    bytes_sent: int = 0


def open_pair_groups(drafter_ranks: Iterable[int], target_ranks: Iterable[int]) -> PairGroups:
    """Two process groups per (drafter, target) pair, one for requests and one for responses,
    keyed (drafter, target); returns this rank's pairs.

    Collective: every rank of the default group calls it with the same lists at the same point
    of its new_group() sequence. Needed on NCCL: with a device bound at init (DeepSpeed binds
    one), point-to-point on the default group shares one stream, so a posted receive from one
    peer would stall every other transfer of the rank; and within a pair, a posted receive would
    stall the sends the other way.
    """
    me = dist.get_rank()
    groups: PairGroups = {}
    for drafter in sorted(drafter_ranks):
        for target in sorted(target_ranks):
            pair = (dist.new_group([drafter, target]), dist.new_group([drafter, target]))
            if me in (drafter, target):
                groups[(drafter, target)] = pair
    return groups


class _Watcher:
    """gloo marks a send/recv complete only inside wait(), and a wait with a timeout breaks the
    connection; so a thread blocks in wait() on each op in posting order (a pair delivers each
    direction in order) and flags it for the polling thread."""

    def __init__(self, name: str) -> None:
        self._ops: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def watch(self, op: _Op) -> None:
        self._ops.put(op)

    def close(self) -> None:
        self._ops.put(None)

    def _run(self) -> None:
        while (op := self._ops.get()) is not None:
            try:
                op.work.wait()
            except Exception as exc:  # handed to the polling thread, which raises TransportError
                op.error = exc
            op.flag.set()


class _Op:
    """One posted isend/irecv; it keeps its tensor alive until the transfer is over."""

    def __init__(self, work: dist.Work, tensor: torch.Tensor, watcher: _Watcher | None) -> None:
        self.work, self.tensor = work, tensor
        self.error: Exception | None = None
        self.flag: threading.Event | None = None
        if watcher is not None:
            self.flag = threading.Event()
            watcher.watch(self)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def done(self) -> bool:
        return self.flag.is_set() if self.flag is not None else self.work.is_completed()

    def pause(self, seconds: float) -> None:
        """Sleep up to `seconds`, waking early when this op completes (gloo)."""
        if self.flag is not None:
            self.flag.wait(seconds)
        else:
            time.sleep(seconds)

    def finish(self) -> None:
        """Raise the transfer's error; on NCCL also order the current stream after it."""
        if self.error is not None:
            raise self.error
        if self.flag is None:
            self.work.wait()


def _no_op() -> None:
    pass


class _Link:
    """The ordered channel from this rank to one peer."""

    def __init__(self, rank: int, role: str, peer: int, send_group: dist.ProcessGroup | None,
                 recv_group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.rank, self.role, self.peer = rank, role, peer
        self._send_group, self._recv_group = send_group, recv_group
        self.peer_role = "target" if role == "drafter" else "drafter"
        gloo = dist.get_backend(send_group) == "gloo"
        self._watchers = (_Watcher(f"send-to-{peer}"), _Watcher(f"recv-from-{peer}")) if gloo else None
        # control traffic runs on a side stream so it never queues behind compute
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def side(self) -> ContextManager:
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def error(self, where: str, what: str, hint: str) -> TransportError:
        return TransportError(f"rank {self.rank} ({self.role}), {where}: {what} "
                              f"[peer: {self.peer_role} rank {self.peer}]. {hint}")

    def send(self, tensor: torch.Tensor, where: str, what: str) -> _Op:
        try:
            work = dist.isend(tensor, dst=self.peer, group=self._send_group)
        except RuntimeError as exc:
            raise self.error(where, f"sending {what} failed ({exc})", self.dead_hint()) from exc
        return _Op(work, tensor, self._watchers[0] if self._watchers else None)

    def recv(self, tensor: torch.Tensor, where: str, what: str) -> _Op:
        try:
            work = dist.irecv(tensor, src=self.peer, group=self._recv_group)
        except RuntimeError as exc:
            raise self.error(where, f"receiving {what} failed ({exc})", self.dead_hint()) from exc
        return _Op(work, tensor, self._watchers[1] if self._watchers else None)

    def wait(self, ops: list[_Op], deadline: float, timeout_s: float, where: str, what: str,
             on_poll: Callable[[], None] = _no_op) -> None:
        """Poll until every op is done (or one failed), then surface their errors."""
        while (pending := [op for op in ops if not op.done()]) and not any(op.error for op in ops):
            if time.monotonic() > deadline:
                raise self.timeout(where, what, timeout_s)
            on_poll()
            pending[0].pause(POLL_S)
        for op in filter(_Op.done, ops):
            try:
                op.finish()
            except Exception as exc:
                raise self.error(where, f"{what} failed ({exc})", self.dead_hint()) from exc

    def read_ints(self, op: _Op, deadline: float, timeout_s: float, where: str, what: str) -> list[int]:
        """Wait for a small int64 message and read it on the host (on CUDA through the side
        stream, so the read does not wait for queued compute)."""
        with self.side():
            self.wait([op], deadline, timeout_s, where, what)
            return op.tensor.tolist()

    def timeout(self, where: str, what: str, timeout_s: float) -> TransportError:
        return self.error(where, f"timed out after {timeout_s:g} s waiting for {what}",
                          f"Check that rank {self.peer} is alive and progressing (its log); "
                          "if it is only slow, raise TransportSpec.timeout_s.")

    def dead_hint(self) -> str:
        return f"Check rank {self.peer}'s log: it probably crashed or exited without closing."

    def close(self) -> None:
        for watcher in self._watchers or ():
            watcher.close()


def _links(rank: int, role: str, peers: list[int], spec: TransportSpec,
           groups: PairGroups | None) -> dict[int, _Link]:
    if groups is None and dist.get_backend() == "nccl":
        raise ValueError("on NCCL the transport needs its own groups for each pair: pass "
                         "groups=open_pair_groups(drafter_ranks, target_ranks), called on every rank")
    links = {}
    for peer in peers:
        requests, responses = (None, None) if groups is None else \
            groups[(rank, peer) if role == "drafter" else (peer, rank)]
        sends, recvs = (requests, responses) if role == "drafter" else (responses, requests)
        links[peer] = _Link(rank, role, peer, sends, recvs, spec.device)
    return links


def _check_hello(link: _Link, mine: list[int], theirs: list[int]) -> None:
    if mine != theirs:
        raise link.error("set-up", f"this transport spec {mine} differs from the peer's {theirs}",
                         "[version, F, D, with_final_hidden, credits, dtype] must match on all "
                         "ranks: build TransportSpec from the same flags everywhere.")


def _close_all(links: dict[int, _Link]) -> None:
    for link in links.values():
        link.close()


def _response_parts(spec: TransportSpec, b: int, length: int) -> list[Part]:
    """The pieces of a response in wire order; int64 first keeps every piece aligned."""
    parts = [(torch.int64, (RESPONSE_HEADER_LEN,)), (torch.int64, (b, length)),
             (spec.feature_dtype, (b, length, spec.feature_dim))]
    if spec.with_final_hidden:
        parts.append((spec.feature_dtype, (b, length, spec.hidden_dim)))
    return [*parts, (torch.uint8, (b, length))]


def _nbytes(parts: list[Part]) -> int:
    return sum(math.prod(shape) * dtype.itemsize for dtype, shape in parts)


def _split(buf: torch.Tensor, parts: list[Part]) -> list[torch.Tensor]:
    """Views of a byte message as its typed pieces."""
    out, offset = [], 0
    for dtype, shape in parts:
        size = math.prod(shape) * dtype.itemsize
        out.append(buf[offset:offset + size].view(dtype).view(shape))
        offset += size
    return out


def _join(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


@dataclass
class _Request:
    step: int
    sample_ids: list[int]
    shape: tuple[int, int]  # (b, S)
    target: int = -1  # the rest is set once the request is sent
    sends: list[_Op] = field(default_factory=list)
    response: _Op | None = None
    arrived: bool = False

    @property
    def tokens(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def sent(self) -> bool:
        return self.response is not None


class DrafterClient:
    """Sends micro-batch requests to the target ranks and hands back their responses in step
    order. Per training step: submit() the sampler's next micro-batches while free_credit() > 0,
    then receive() the step to train on."""

    def __init__(self, rank: int, target_ranks: list[int], spec: TransportSpec, lengths: np.ndarray,
                 node_of: dict[int, int] | None = None, groups: PairGroups | None = None) -> None:
        self.rank, self.spec, self.targets = rank, spec, sorted(target_ranks)
        self.lengths = np.asarray(lengths)
        node_of = node_of or {}
        self._same_node = {t: node_of.get(t) == node_of.get(rank) for t in self.targets}
        self._links = _links(rank, "drafter", self.targets, spec, groups)
        self._held: OrderedDict[int, _Request] = OrderedDict()  # submitted, not yet received
        self._waiting: deque[_Request] = deque()  # submitted, not sent yet: routed when sent
        self._in_flight = {t: 0 for t in self.targets}
        self._backlog = {t: 0 for t in self.targets}  # tokens of other drafters, as last reported
        self._sec_per_token: dict[int, float] = {}
        self._window = 2 * spec.credits * len(self.targets)
        self._closed = self._failed = False
        try:
            self._handshake()
        except TransportError:
            _close_all(self._links)
            raise

    def free_credit(self) -> int:
        """How many more steps may be submitted now."""
        self._guarded(self._progress)
        return self._window - len(self._held)

    def queue_depths(self) -> dict[int, int]:
        """Requests in flight per target rank (sent, response not fully arrived); at most credits."""
        self._guarded(self._progress)
        return dict(self._in_flight)

    def submit(self, step: int, sample_ids: list[int]) -> int | None:
        """Send one micro-batch to the target expected to finish it first and post the receive
        for its response now, so the transfer overlaps this rank's compute; returns that target.
        When that target has no free credit, the request waits here and is routed and sent as
        soon as a credit returns (returns None)."""
        if self._closed or step in self._held or not sample_ids:
            raise ValueError(f"cannot submit step {step}: client closed, step pending, or no sample ids")
        if self.free_credit() == 0:
            raise TransportError(f"rank {self.rank} (drafter), step {step}: no free credit "
                                 f"({len(self._held)} steps held, in flight per target {self._in_flight}); "
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

    def close(self) -> None:
        """Send STOP to every target once the requests in flight are answered. After a
        TransportError nothing is sent: peers are gone or out of step; tear the group down."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self._failed:
                self._stop_all()
        finally:
            _close_all(self._links)

    def _guarded(self, fn: Callable, *args):
        try:
            return fn(*args)
        except TransportError:
            self._failed = True
            raise

    def _handshake(self) -> None:
        # the same order on both sides: NCCL may set up a pair's communicator at its first transfer
        deadline = time.monotonic() + self.spec.timeout_s
        for target in self.targets:
            link = self._links[target]
            with link.side():
                mine = torch.tensor(self.spec.hello(), dtype=torch.int64, device=self.spec.device)
                sent = link.send(mine, "set-up", "the hello")
                reply = link.recv(torch.empty_like(mine), "set-up", "the hello")
            theirs = link.read_ints(reply, deadline, self.spec.timeout_s, "set-up", "the hello")
            link.wait([sent], deadline, self.spec.timeout_s, "set-up", "the hello")
            _check_hello(link, self.spec.hello(), theirs)

    def _pick_target(self, tokens: int) -> int | None:
        """The target expected to finish this request first (see the module notes), or None
        while that one has no free credit."""
        # one request at a time to a target that has not reported its speed yet: loading it
        # blindly would give a slow target as much as a fast one
        candidates = [t for t in self.targets if t in self._sec_per_token or self._in_flight[t] == 0]
        known = list(self._sec_per_token.values())
        default = sum(known) / len(known) if known else 1.0  # unmeasured: as fast as the others
        pending = {t: self._backlog[t] + tokens for t in self.targets}
        for req in self._held.values():
            if req.sent and not req.arrived:
                pending[req.target] += req.tokens
        best = min(candidates, default=None, key=lambda t: (
            pending[t] * self._sec_per_token.get(t, default), not self._same_node[t], t))
        return best if best is not None and self._in_flight[best] < self.spec.credits else None

    def _progress(self) -> None:
        """Return the credits of fully arrived responses, then send waiting requests, oldest
        first, while the target each is best routed to has a free credit."""
        for req in self._held.values():
            if req.sent and not req.arrived and req.response.done():
                self._arrived(req)
        while self._waiting and (target := self._pick_target(self._waiting[0].tokens)) is not None:
            self._send(self._waiting.popleft(), target)

    def _send(self, req: _Request, target: int) -> None:
        req.target = target
        link, spec, where = self._links[target], self.spec, f"step {req.step}"
        b, length = req.shape
        with link.side():  # so neither the request nor the receives wait for queued compute
            header = torch.tensor([REQUEST, req.step, b, length], dtype=torch.int64, device=spec.device)
            ids = torch.tensor(req.sample_ids, dtype=torch.int64, device=spec.device)
            req.sends = [link.send(header, where, "the request"), link.send(ids, where, "the request")]
            size = _nbytes(_response_parts(spec, b, length))
            req.response = link.recv(torch.empty(size, dtype=torch.uint8, device=spec.device),
                                     where, "the response")
        self._in_flight[req.target] += 1

    def _arrived(self, req: _Request) -> None:
        req.arrived = True
        self._in_flight[req.target] -= 1

    def _take(self, req: _Request) -> FeatureBatch:
        timeout, where = self.spec.timeout_s, f"step {req.step}"
        deadline = time.monotonic() + timeout
        while not req.sent:
            if time.monotonic() > deadline:
                raise TransportError(f"rank {self.rank} (drafter), {where}: timed out after {timeout:g} s "
                                     f"waiting for a free credit (in flight per target {self._in_flight}). "
                                     "Check the targets' logs: they stopped answering.")
            self._progress()
            time.sleep(POLL_S)
        link = self._links[req.target]
        link.wait(req.sends, deadline, timeout, where, "the request", self._progress)
        with link.side():
            link.wait([req.response], deadline, timeout, where, "the response", self._progress)
            parts = _split(req.response.tensor, _response_parts(self.spec, *req.shape))
            header, input_ids, features, *rest, mask = parts
            got_step, status, b, length, backlog, service_us = header.tolist()
        if (got_step, status, (b, length)) != (req.step, STATUS_OK, req.shape):
            raise link.error(where, f"bad response header (step {got_step}, status {status}, shape "
                             f"{(b, length)}; expected step {req.step}, shape {req.shape})",
                             "Check that both sides read the same dataset (lengths), and the target's log.")
        if not req.arrived:
            self._arrived(req)
        self._learn_speed(req, backlog, service_us)
        if self.spec.device.type == "cuda":  # received on the side stream, used on the current one
            req.response.work.wait()
            req.response.tensor.record_stream(torch.cuda.current_stream(self.spec.device))
        return FeatureBatch(req.step, input_ids, mask.bool(), features, rest[0] if rest else None, req.target)

    def _learn_speed(self, req: _Request, backlog: int, service_us: int) -> None:
        self._backlog[req.target] = backlog
        if service_us <= 0:  # the target has not timed a request yet
            return
        sample = service_us * 1e-6 / req.tokens
        old = self._sec_per_token.get(req.target, sample)
        self._sec_per_token[req.target] = (1 - SPEED_SMOOTHING) * old + SPEED_SMOOTHING * sample

    def _stop_all(self) -> None:
        deadline = time.monotonic() + self.spec.timeout_s
        self._waiting.clear()  # never sent: nothing to drain
        sent = [req for req in self._held.values() if req.sent]
        stops = {}
        for target, link in self._links.items():
            with link.side():
                stop = torch.tensor([STOP, -1, 0, 0], dtype=torch.int64, device=self.spec.device)
                stops[target] = link.send(stop, "close", "STOP")
        for req in sent:  # drained, so no transfer is cut off at teardown
            self._links[req.target].wait([*req.sends, req.response], deadline, self.spec.timeout_s,
                                         f"step {req.step}", "the response")
        self._held.clear()
        for target, op in stops.items():
            self._links[target].wait([op], deadline, self.spec.timeout_s, "close", "STOP")


class _ServiceClock:
    """How long the last finished request took to compute. On CUDA the forward runs
    asynchronously, so it is timed with events and read once they have completed."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._open: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._last_s = 0.0

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        if not self._cuda:
            started = time.perf_counter()
            yield
            self._last_s = time.perf_counter() - started
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._open.append((start, end))

    def last_us(self) -> int:
        while self._open and self._open[0][1].query():
            start, end = self._open.popleft()
            self._last_s = start.elapsed_time(end) / 1e3
        return round(self._last_s * 1e6)


@dataclass
class _Arrival:
    drafter: int
    step: int
    shape: tuple[int, int]  # (b, S) the drafter expects
    ids: _Op


@dataclass
class _ServeState:
    headers: dict[int, _Op]  # the posted header receive per live drafter
    arrivals: deque[_Arrival] = field(default_factory=deque)  # FIFO in the order seen complete
    sends: dict[int, deque[tuple[int, _Op]]] = field(default_factory=dict)  # (step, response) in flight
    live: set[int] = field(default_factory=set)  # drafters that have not sent STOP
    last_step: dict[int, int] = field(default_factory=dict)

    def backlog(self, drafter: int) -> int:
        """Tokens queued here by the other drafters."""
        return sum(a.shape[0] * a.shape[1] for a in self.arrivals if a.drafter != drafter)


class TargetServer:
    """Serves drafter requests: compute(sample_ids) -> (input_ids [b,S], loss_mask [b,S] bool,
    features [b,S,F], final_hidden [b,S,D] | None), S the longest of those samples."""

    def __init__(self, rank: int, drafter_ranks: list[int], spec: TransportSpec,
                 compute: Callable[[list[int]], Computed], groups: PairGroups | None = None) -> None:
        self.rank, self.spec, self.compute, self.drafters = rank, spec, compute, sorted(drafter_ranks)
        self._links = _links(rank, "target", self.drafters, spec, groups)
        self._clock = _ServiceClock(spec.device)
        try:
            self._handshake()
        except TransportError:
            _close_all(self._links)
            raise

    def serve(self) -> ServeStats:
        """Serve until every drafter sent STOP. Raises TransportError when no live drafter sends
        anything for timeout_s, or when a transfer fails."""
        stats = ServeStats({d: 0 for d in self.drafters})
        state = _ServeState({d: self._post_header(d, "the first request") for d in self.drafters},
                            sends={d: deque() for d in self.drafters}, live=set(self.drafters))
        last_seen = time.monotonic()
        try:
            while state.live or state.arrivals:
                if self._collect(state):
                    last_seen = time.monotonic()
                self._reap(state, stats, wait=False)
                now = time.monotonic()
                if state.arrivals:
                    self._serve_one(state.arrivals.popleft(), state, stats)
                    last_seen = time.monotonic()
                    stats.busy_s += last_seen - now
                elif now - last_seen > self.spec.timeout_s:
                    raise TransportError(
                        f"rank {self.rank} (target): no request or STOP from drafter ranks "
                        f"{sorted(state.live)} for {self.spec.timeout_s:g} s (last step seen from each: "
                        f"{state.last_step}). Check those ranks' logs: a drafter that died, hung, "
                        "or paused without close() leaves its targets waiting.")
                else:
                    time.sleep(POLL_S)
                    stats.idle_s += time.monotonic() - now
            self._reap(state, stats, wait=True)
        finally:
            _close_all(self._links)
        logger.info("target rank %d served %s requests, busy %.1f s, idle %.1f s, %.1f MB sent",
                    self.rank, stats.requests, stats.busy_s, stats.idle_s, stats.bytes_sent / 1e6)
        return stats

    def _handshake(self) -> None:
        deadline = time.monotonic() + self.spec.timeout_s
        for drafter in self.drafters:  # the order in which every drafter walks its targets
            link = self._links[drafter]
            with link.side():
                mine = torch.tensor(self.spec.hello(), dtype=torch.int64, device=self.spec.device)
                hello = link.recv(torch.empty_like(mine), "set-up", "the hello")
            theirs = link.read_ints(hello, deadline, self.spec.timeout_s, "set-up", "the hello")
            with link.side():
                reply = link.send(mine, "set-up", "the hello")
            link.wait([reply], deadline, self.spec.timeout_s, "set-up", "the hello")
            _check_hello(link, self.spec.hello(), theirs)

    def _post_header(self, drafter: int, where: str) -> _Op:
        link = self._links[drafter]
        with link.side():
            buf = torch.empty(REQUEST_HEADER_LEN, dtype=torch.int64, device=self.spec.device)
            return link.recv(buf, where, "a request")

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
                with link.side():
                    ids = link.recv(torch.empty(n, dtype=torch.int64, device=self.spec.device),
                                    f"step {step}", "the sample ids")
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
        status = STATUS_BAD_SHAPE if problem else STATUS_OK
        header = torch.tensor([arrival.step, status, *arrival.shape, state.backlog(arrival.drafter),
                               self._clock.last_us()], dtype=torch.int64, device=spec.device)
        if problem:  # the drafter still expects a message of the full size
            size = _nbytes(_response_parts(spec, *arrival.shape)) - header.numel() * header.element_size()
            tensors = [torch.zeros(size, dtype=torch.uint8, device=spec.device)]
        in_flight.append((arrival.step, link.send(_join([header, *tensors]), where, "the response")))
        stats.requests[arrival.drafter] += 1
        if problem:
            raise link.error(where, f"compute() returned {problem}",
                             "Check that both sides read the same dataset (lengths).")

    def _wire_tensors(self, computed: Computed, shape: tuple[int, int]) -> tuple[list[torch.Tensor], str]:
        """The response tensors in wire order and dtypes, or what does not fit the request."""
        spec = self.spec
        input_ids, loss_mask, features, final_hidden = computed
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
            while in_flight and (wait or in_flight[0][1].done()):
                self._retire(drafter, *in_flight.popleft(), stats, deadline)

    def _retire(self, drafter: int, step: int, op: _Op, stats: ServeStats, deadline: float) -> None:
        self._links[drafter].wait([op], deadline, self.spec.timeout_s, f"step {step}", "the response")
        stats.bytes_sent += op.nbytes
