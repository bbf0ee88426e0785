"""The channels between one drafter rank and one target rank, and bounded waits on them.

Each (drafter, target) pair gets two process groups (open_pair_groups):
  control  gloo, CPU int64 messages both ways (hello, requests, STOP, response headers);
  data     the default backend: NCCL on GPUs, gloo on CPU; only target -> drafter payloads.
Why the split: a posted NCCL receive is a kernel that waits on the GPU, and any device-wide
synchronisation on that GPU (lazy kernel loading, the caching allocator's cudaFree) then waits
for the matching send. A target that posted a receive for the next request before its own
forward could deadlock with a drafter waiting for that forward's features. So no rank ever posts
an NCCL receive for a message that depends on its own progress: targets only send on NCCL, and
a drafter posts the receive for a payload before it sends the request for it, on a side stream
that has no queued compute to wait behind. Every wait polls against a deadline, so a dead or
silent peer ends in a TransportError naming both ranks instead of a hang.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable

import torch
import torch.distributed as dist

from dflash.placement.transport.wire import TransportError

POLL_S = 2e-4


@dataclass
class PairGroup:
    control: dist.ProcessGroup  # gloo
    data: dist.ProcessGroup  # default backend


PairGroups = dict[tuple[int, int], PairGroup]  # keyed (drafter, target)


def open_pair_groups(drafter_ranks: Iterable[int], target_ranks: Iterable[int]) -> PairGroups:
    """This rank's pair groups, keyed (drafter, target). Collective: every rank of the default
    group calls it with the same lists at the same point of its new_group() sequence."""
    me, groups = dist.get_rank(), {}
    for drafter in sorted(drafter_ranks):
        for target in sorted(target_ranks):
            pair = PairGroup(dist.new_group([drafter, target], backend="gloo"), dist.new_group([drafter, target]))
            if me in (drafter, target):
                groups[(drafter, target)] = pair
    return groups


class _Watcher:
    """gloo marks a send/recv complete only inside wait(), and a wait with a timeout breaks the
    connection; so a thread blocks in wait() on each op in posting order (a pair delivers each
    direction in order) and flags it for the polling thread."""

    def __init__(self, name: str) -> None:
        self._ops: queue.SimpleQueue[Op | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, op: Op) -> None:
        self._ops.put(op)

    def close(self, wait_s: float) -> None:
        """Stop after the ops already handed over; wait up to `wait_s` for that, so no thread is
        still inside a transfer when the process group is torn down (a peer that is gone can
        hold one: then the thread is left behind, a daemon)."""
        self._ops.put(None)
        self._thread.join(wait_s)

    def _run(self) -> None:
        while (op := self._ops.get()) is not None:
            try:
                op.work.wait()
            except Exception as exc:  # handed to the polling thread, which raises TransportError
                op.failed_at = time.monotonic()
                op.error = exc
            op.flag.set()


class Op:
    """One posted isend/irecv; it keeps its tensor alive until the transfer is over. A gloo op is
    watched by a thread; an NCCL op by a CUDA event recorded after it on a completion stream,
    since querying the NCCL work object takes the process group's locks, which its watchdog
    can hold indefinitely once a peer has died."""

    def __init__(self, work: dist.Work, tensor: torch.Tensor, watcher: _Watcher | None,
                 completion: torch.cuda.Stream | None = None) -> None:
        self.work, self.tensor = work, tensor
        self.posted_at, self.failed_at = time.monotonic(), 0.0
        self.error: Exception | None = None
        self.flag: threading.Event | None = None
        self.event: torch.cuda.Event | None = None
        if watcher is not None:
            self.flag = threading.Event()
            watcher.watch(self)
        elif completion is not None:
            with torch.cuda.stream(completion):
                work.wait()  # the completion stream waits for the NCCL stream (no host wait)
                self.event = torch.cuda.Event()
                self.event.record()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def done(self) -> bool:
        if self.flag is not None:
            return self.flag.is_set()
        return self.event.query()

    def pause(self, seconds: float) -> None:
        """Sleep up to `seconds`, waking early when a watched (gloo) op completes."""
        if self.flag is not None:
            self.flag.wait(seconds)
        else:
            time.sleep(seconds)

    def finish(self) -> None:
        """Raise the transfer's error; on NCCL also order the current stream after it."""
        if self.error is not None:
            raise self.error
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


def _no_op() -> None:
    pass


class Link:
    """This rank's two channels to one peer, with errors that name both ends."""

    def __init__(self, rank: int, role: str, peer: int, groups: PairGroup, device: torch.device) -> None:
        self.rank, self.role, self.peer = rank, role, peer
        self.peer_role = "target" if role == "drafter" else "drafter"
        self._groups = groups
        self._lock = threading.Lock()
        self._control_ops: deque[Op] = deque()  # posted, not yet seen complete (for the watchdog)
        self._control_watchers = (_Watcher(f"control-to-{peer}"), _Watcher(f"control-from-{peer}"))
        gloo_data = dist.get_backend(groups.data) == "gloo"
        self._data_watchers = (_Watcher(f"data-to-{peer}"), _Watcher(f"data-from-{peer}")) if gloo_data else None
        self._device = device
        # payload receives go on a side stream: NCCL orders its stream after the current one,
        # and a receive queued behind this rank's compute would keep the sender's kernel waiting
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" and not gloo_data else None
        self._completion = torch.cuda.Stream(device) if self._stream is not None else None
        self.polled_at = time.monotonic()  # when the main thread last waited on this link (see Watchdog)

    # ---- posting
    def send_ints(self, values: list[int], where: str, what: str) -> Op:
        tensor = torch.tensor(values, dtype=torch.int64)
        return self._track(self._post(dist.isend, tensor, self._groups.control, self._control_watchers[0], where, what))

    def recv_ints(self, n: int, where: str, what: str) -> Op:
        tensor = torch.empty(n, dtype=torch.int64)
        return self._track(self._post(dist.irecv, tensor, self._groups.control, self._control_watchers[1], where, what))

    def _track(self, op: Op) -> Op:
        with self._lock:
            self._control_ops.append(op)
        return op

    def stalled(self, timeout_s: float, grace_s: float) -> str | None:
        """What is wrong on the control channel, judged from its watcher threads alone (no CUDA
        call, so it can be asked while the main thread is stuck): a transfer that failed `grace_s`
        ago, or one outstanding for timeout_s + grace_s."""
        now = time.monotonic()
        with self._lock:
            self._control_ops = deque(op for op in self._control_ops if not (op.flag.is_set() and op.error is None))
            ops = list(self._control_ops)
        for op in ops:
            if op.error is not None and now - op.failed_at > grace_s:
                return f"a transfer with {self.peer_role} rank {self.peer} failed ({op.error})"
            if op.error is None and now - op.posted_at > timeout_s + grace_s:
                return f"{self.peer_role} rank {self.peer} has not answered for {now - op.posted_at:.0f} s"
        return None

    def send_payload(self, tensor: torch.Tensor, where: str) -> Op:
        watcher = self._data_watchers[0] if self._data_watchers else None
        return self._post(dist.isend, tensor, self._groups.data, watcher, where, "the response payload")

    def recv_payload(self, nbytes: int, where: str) -> Op:
        watcher = self._data_watchers[1] if self._data_watchers else None
        with self._side():
            tensor = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
            return self._post(dist.irecv, tensor, self._groups.data, watcher, where, "the response payload")

    def _side(self) -> ContextManager:
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def _post(self, fn: Callable, tensor: torch.Tensor, group: dist.ProcessGroup, watcher: _Watcher | None,
              where: str, what: str) -> Op:
        try:
            work = fn(tensor, self.peer, group=group)
        except RuntimeError as exc:
            raise self.error(where, f"posting {what} failed ({exc})", self.dead_hint()) from exc
        return Op(work, tensor, watcher, self._completion if group is self._groups.data else None)

    # ---- waiting
    def wait(self, ops: list[Op], deadline: float, timeout_s: float, where: str, what: str,
             on_poll: Callable[[], None] = _no_op) -> None:
        """Poll until every op is done (or one failed), then surface their errors."""
        while (pending := [op for op in ops if not op.done()]) and not any(op.error for op in ops):
            self.polled_at = time.monotonic()
            if self.polled_at > deadline:
                raise self.timeout(where, what, timeout_s)
            on_poll()
            pending[0].pause(POLL_S)
        for op in filter(Op.done, ops):
            try:
                op.finish()
            except Exception as exc:
                raise self.error(where, f"{what} failed ({exc})", self.dead_hint()) from exc

    def read_ints(self, op: Op, deadline: float, timeout_s: float, where: str, what: str) -> list[int]:
        self.wait([op], deadline, timeout_s, where, what)
        return op.tensor.tolist()

    def hand_over(self, op: Op) -> torch.Tensor:
        """A received payload, ready for use on the current stream."""
        if self._stream is not None:
            op.finish()  # the current stream waits for the transfer
            op.tensor.record_stream(torch.cuda.current_stream(self._device))
        return op.tensor

    # ---- errors and teardown
    def error(self, where: str, what: str, hint: str, timed_out: bool = False) -> TransportError:
        return TransportError(f"rank {self.rank} ({self.role}), {where}: {what} "
                              f"[peer: {self.peer_role} rank {self.peer}]. {hint}", self.peer, timed_out)

    def timeout(self, where: str, what: str, timeout_s: float) -> TransportError:
        return self.error(where, f"timed out after {timeout_s:g} s waiting for {what}",
                          f"Check that rank {self.peer} is alive and progressing (its log); "
                          "if it is only slow, raise --transport-timeout-s.", timed_out=True)

    def dead_hint(self) -> str:
        return f"Check rank {self.peer}'s log: it probably crashed or exited without closing."

    def close(self, wait_s: float = 5.0) -> None:
        for watcher in (*self._control_watchers, *(self._data_watchers or ())):
            watcher.close(wait_s)


class Watchdog:
    """Ends this process when its main thread cannot. The main thread raises TransportError for
    every failure it can see; but once a peer is gone, a CUDA call on this rank (a kernel loaded
    on first use, a synchronising free) can wait forever behind an NCCL transfer from that peer,
    in the driver, where no Python timeout runs. So a thread checks the control channels once
    a second, and if a failure stands `grace_s` longer than the main thread needed to notice it,
    while the main thread has not waited on any link for `grace_s` (one that does raises the
    failure itself, at its own deadline), it reports the failure and exits. Disarm it once the
    main thread has taken over (it raised, or closed the transport)."""

    def __init__(self, rank: int, role: str, links: dict[int, Link], timeout_s: float, grace_s: float) -> None:
        self.rank, self.role, self._links = rank, role, links
        self.timeout_s, self.grace_s = timeout_s, grace_s
        self._disarmed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="transport-watchdog", daemon=True)
        self._thread.start()

    def disarm(self) -> None:
        self._disarmed.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _run(self) -> None:
        while not self._disarmed.wait(1.0):
            links = list(self._links.values())
            if time.monotonic() - max(link.polled_at for link in links) <= self.grace_s:
                continue  # the main thread is waiting on the transport: it will see the failure
            for link in links:
                problem = link.stalled(self.timeout_s, self.grace_s)
                if problem and not self._disarmed.is_set():
                    self._exit(problem)

    def _exit(self, problem: str) -> None:
        message = (f"TransportError: rank {self.rank} ({self.role}): {problem}, and this rank's main thread "
                   f"has not returned to notice it in {self.grace_s:g} s (probably inside a CUDA call waiting on "
                   "a transfer from that peer). Exiting; check the peer's log.")
        logging.getLogger(__name__).error("%s", message)
        os.write(2, (message + "\n").encode())
        os._exit(1)


def open_links(rank: int, role: str, peers: list[int], groups: PairGroups, device: torch.device) -> dict[int, Link]:
    missing = [p for p in peers if ((rank, p) if role == "drafter" else (p, rank)) not in groups]
    if missing:
        raise ValueError(f"rank {rank} ({role}): no pair groups with ranks {missing}: pass "
                         "open_pair_groups(drafter_ranks, target_ranks), called on every rank")
    return {p: Link(rank, role, p, groups[(rank, p) if role == "drafter" else (p, rank)], device) for p in peers}


def close_links(links: dict[int, Link], clean: bool) -> None:
    """After a clean end, wait (briefly) for the watcher threads to finish; after a failure do not
    wait: a watcher may be stuck on the peer that failed."""
    for link in links.values():
        link.close(5.0 if clean else 0.0)


def check_hello(link: Link, mine: list[int], theirs: list[int]) -> None:
    if mine != theirs:
        raise link.error("set-up", f"this transport spec {mine} differs from the peer's {theirs}",
                         "[version, F, D, with_final_hidden, credits, dtype] must match on all "
                         "ranks: build TransportSpec from the same flags everywhere.")
