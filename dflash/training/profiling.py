"""`--profile-steps N`: a torch.profiler window over N optimizer steps late in the run, written
to <output-dir>/profile/ as a Chrome trace and a table of GPU time by kernel family.

The table is the account of where a step's GPU time goes (matmuls, attention, the fused
elementwise kernels, optimizer, copies, communication) and how much of the window the GPU was
busy at all. The rest is host time (Python, launches, synchronisation): the trace's GPU timeline
says where in the step the GPU waited, by the kernels that end and start each idle gap. Only GPU
activity is recorded, so that the profiler's own per-op work on the host does not widen the gaps.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Trace categories of work on the GPU (kernels, copies, memsets).
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
# A stream kept fed starts a kernel within a few microseconds of the last one's end; a longer gap
# means the GPU waited for the host (the list names such gaps; the idle total counts every gap).
GAP_FLOOR_US = 20.0

# Kernel-name fragments -> family, first match wins.
FAMILIES = [
    ("attention", ("flex", "flash", "fmha", "attention", "triton_tem")),
    ("matmul", ("gemm", "xmma", "cutlass", "cublas", "sm90_", "sm80_", "nvjet", "matmul")),
    ("optimizer", ("adam", "multi_tensor")),
    ("communication", ("nccl",)),
    ("copy", ("memcpy", "memset", "copy_kernel", "catarray")),
    ("fused elementwise (compiled)", ("triton_",)),
    ("softmax / loss", ("softmax", "logsumexp", "cross_entropy", "nll")),
    ("reduction", ("reduce", "norm")),
    ("elementwise (eager)", ("elementwise", "vectorized", "unrolled")),
]


def family(kernel: str) -> str:
    name = kernel.lower()
    return next((fam for fam, keys in FAMILIES if any(k in name for k in keys)), "other")


class StepProfiler:
    """Profiles optimizer steps [start, start + steps) when steps > 0 (CUDA only)."""

    def __init__(self, out_dir: Path, start: int, steps: int, device: torch.device, enabled: bool):
        self.active = enabled and steps > 0 and device.type == "cuda"
        self.out_dir, self.start, self.stop = out_dir / "profile", start, start + steps
        self.profiler = None

    def step_done(self, global_step: int) -> None:
        """Call after every optimizer step."""
        if not self.active:
            return
        if self.profiler is None and global_step == self.start:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            torch.cuda.synchronize()
            self.profiler.__enter__()
            self.started = time.perf_counter()
        elif self.profiler is not None and global_step == self.stop:
            torch.cuda.synchronize()
            wall = time.perf_counter() - self.started
            self.profiler.__exit__(None, None, None)
            self.write(wall, self.stop - self.start)
            self.profiler, self.active = None, False

    def write(self, wall_s: float, steps: int) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / "trace.json"
        self.profiler.export_chrome_trace(str(trace))
        summary = summarize(gpu_timeline(json.loads(trace.read_text())), wall_s, steps)
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        gaps = summary["host_gaps"]
        logger.info("profile of %d steps: %.0f ms/step wall, GPU busy %.0f%%; GPU time by kernel family %s; "
                    "the GPU waited %.1f ms a step, most after %s (%s)", steps, 1e3 * wall_s / steps,
                    100 * summary["gpu_busy_fraction"], summary["share_of_gpu_time"], gaps["idle_ms_per_step"],
                    "; ".join(f"{g['after'][:40]} ({g['ms_per_step']} ms)" for g in gaps["largest"][:3]) or "none",
                    self.out_dir)


def summarize(work: list[tuple[float, float, str]], wall_s: float, steps: int) -> dict:
    """The profile's summary from its GPU timeline (gpu_timeline) and the window's wall time."""
    by_family: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    for start, end, name in work:
        by_family[family(name)] += (end - start) / 1e6
        top[name] += (end - start) / 1e6
    busy = sum(by_family.values())
    return {
        "steps": steps, "wall_s_per_step": wall_s / steps, "gpu_busy_s_per_step": busy / steps,
        "gpu_busy_fraction": busy / wall_s if wall_s else 0.0,
        "share_of_gpu_time": {k: round(v / busy, 4) if busy else 0.0
                              for k, v in sorted(by_family.items(), key=lambda x: -x[1])},
        "top_kernels_ms_per_step": {k[:120]: round(v / steps * 1e3, 2)
                                    for k, v in sorted(top.items(), key=lambda x: -x[1])[:25]},
        "host_gaps": idle_gaps(work, steps),
    }


def gpu_timeline(trace: dict) -> list[tuple[float, float, str]]:
    """(start, end, name) in microseconds of each piece of GPU work in a Chrome trace, by start."""
    return sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e["name"])
                  for e in trace.get("traceEvents", [])
                  if e.get("ph") == "X" and e.get("cat") in GPU_WORK)


def idle_gaps(work: list[tuple[float, float, str]], steps: int, top: int = 10) -> dict:
    """When no stream had work: the idle time a step between the first start and the last end, and
    the gaps of at least GAP_FLOOR_US summed by where they sit (the work that ended last before
    each, and the work that started it again)."""
    if not work:
        return {"span_ms_per_step": 0.0, "idle_ms_per_step": 0.0, "largest": []}
    idle, busy_until, last = 0.0, work[0][1], work[0][2]
    sites: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for start, end, name in work[1:]:
        if start > busy_until:
            gap = start - busy_until
            idle += gap
            if gap >= GAP_FLOOR_US:
                site = sites[(last[:100], name[:100])]
                site[0] += gap
                site[1] += 1
        if end >= busy_until:
            busy_until, last = end, name
    span = busy_until - work[0][0]
    largest = sorted(sites.items(), key=lambda item: -item[1][0])[:top]
    return {
        "span_ms_per_step": round(span / steps / 1e3, 3),
        "idle_ms_per_step": round(idle / steps / 1e3, 3),
        "largest": [{"after": after, "before": before, "ms_per_step": round(total / steps / 1e3, 3),
                     "gaps_per_step": round(count / steps, 2)}
                    for (after, before), (total, count) in largest],
    }
