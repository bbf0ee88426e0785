"""Replay a decode step as a CUDA graph: at batch 1 a small target's step is a few hundred tiny
kernels, and launching them from Python costs far more than running them (an HF-eager
SmolLM2-135M step: 25 ms on an H200, almost all of it launch overhead)."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import torch


class GraphReplays:
    """Runs `step()` as a captured CUDA graph, one capture per key; eagerly off CUDA.

    `step` must read and write only tensors that live as long as this object (its inputs are
    preallocated buffers the caller fills before each call); what it returns is overwritten by
    the next replay of any key, so callers use or copy it before that. The graphs share one
    memory pool and warm up on one side stream: a batched step's activations (logits of every
    row, masks over the cache) are held once, not once per captured shape."""

    # Every capture in this process, and the seconds they took (warm-up included): batched
    # regeneration captures again whenever a batch changes shape, and reports what that cost.
    captures = 0
    capture_seconds = 0.0

    def __init__(self, device: torch.device, enabled: bool = True):
        self.enabled = enabled and device.type == "cuda"
        self._captured: dict[Hashable, tuple[torch.cuda.CUDAGraph, object]] = {}
        self._pool = None
        self._side = None

    def __contains__(self, key: Hashable) -> bool:
        return key in self._captured

    def __call__(self, key: Hashable, step: Callable[[], object]):
        if not self.enabled:
            return step()
        if key not in self._captured:
            started = time.perf_counter()
            self._captured[key] = self._capture(step)
            GraphReplays.captures += 1
            GraphReplays.capture_seconds += time.perf_counter() - started
        graph, outputs = self._captured[key]
        graph.replay()
        return outputs

    def _capture(self, step: Callable[[], object]):
        # Warm-up on a side stream (lazy inits and allocator pools settle before capture); a
        # step only rewrites its outputs from the current inputs, so running it again is harmless.
        if self._side is None:
            self._pool, self._side = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(self._side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = step()
        return graph, outputs
