"""Where a training step's wall time goes, without slowing it down.

`mark(phase)` closes the phase that ran since the previous mark. On a GPU a mark records a
CUDA event on the current stream, so nothing waits; the elapsed time between two events is the
GPU time of the work queued in between plus any time the GPU sat idle waiting for the host to
queue it (host work shows up in the phase it delays). `split()` waits for the last event, once
per log window. On a CPU (synchronous) it is plain wall time.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch


class PhaseClock:
    def __init__(self, device: torch.device):
        self.on_gpu = device.type == "cuda"
        self._pending: list[tuple[str, object, object]] = []
        self._last = self._now()

    def _now(self):
        if self.on_gpu:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def mark(self, phase: str) -> None:
        """The time since the previous mark was spent in `phase`."""
        now = self._now()
        self._pending.append((phase, self._last, now))
        self._last = now

    def split(self) -> dict[str, float]:
        """Seconds per phase since the previous split."""
        totals: dict[str, float] = defaultdict(float)
        if self._pending and self.on_gpu:
            self._pending[-1][2].synchronize()
        for phase, start, stop in self._pending:
            totals[phase] += start.elapsed_time(stop) / 1e3 if self.on_gpu else stop - start
        self._pending.clear()
        return dict(totals)
