"""`--profile-steps N`: a torch.profiler window over N optimizer steps late in the run, written
to <output-dir>/profile/ as a Chrome trace and a table of GPU time by kernel family.

The table is the account of where a step's GPU time goes (matmuls, attention, the fused
elementwise kernels, optimizer, copies, communication) and how much of the window the GPU was
busy at all (the rest is host time: Python, launches, synchronisation).
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

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
            self.profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
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
        self.profiler.export_chrome_trace(str(self.out_dir / "trace.json"))
        by_family: dict[str, float] = defaultdict(float)
        top: dict[str, float] = defaultdict(float)
        for event in self.profiler.events():
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            micros = getattr(event, "device_time", None) or getattr(event, "cuda_time", 0.0)
            by_family[family(event.name)] += micros / 1e6
            top[event.name] += micros / 1e6
        busy = sum(by_family.values())
        summary = {
            "steps": steps, "wall_s_per_step": wall_s / steps, "gpu_busy_s_per_step": busy / steps,
            "gpu_busy_fraction": busy / wall_s if wall_s else 0.0,
            "share_of_gpu_time": {k: round(v / busy, 4) for k, v in sorted(by_family.items(), key=lambda x: -x[1])},
            "top_kernels_ms_per_step": {k[:120]: round(v / steps * 1e3, 2)
                                        for k, v in sorted(top.items(), key=lambda x: -x[1])[:25]},
        }
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        logger.info("profile of %d steps: %.0f ms/step wall, GPU busy %.0f%%; GPU time by kernel family %s "
                    "(%s)", steps, 1e3 * wall_s / steps, 100 * summary["gpu_busy_fraction"],
                    summary["share_of_gpu_time"], self.out_dir)
