"""`--profile-steps N`: a torch.profiler window over N optimizer steps late in the run, written
to <output-dir>/profile/ as a Chrome trace and a table of GPU time by kernel family.

The table is the account of where a step's GPU time goes (matmuls, attention, the fused
elementwise kernels, optimizer, copies, communication) and how much of the window the GPU was
busy at all. The rest is host time (Python, launches, synchronisation): the trace's GPU timeline
says where in the step the GPU waited, by the kernels that end and start each idle gap. Only GPU
activity is recorded, so that the profiler's own per-op work on the host does not widen the gaps;
`--profile-host` records the host's ops and Python calls too and names the op or call the host was
in while the GPU waited, and the innermost function of ours then open (at the price of wider gaps:
the profiler's own work on each op and call).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Trace categories of work on the GPU (kernels, copies, memsets).
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
# A stream kept fed starts a kernel within a few microseconds of the last one's end; a longer gap
# means the GPU waited for the host (the list names such gaps; the idle total counts every gap).
GAP_FLOOR_US = 20.0
# Host-side trace categories: aten ops, record_function ranges and Python calls (the training thread's
# call tree; Python calls are recorded with the stack, under --profile-host).
HOST_WORK = ("cpu_op", "user_annotation", "python_function")
# A Python call's trace name is "path(line): function"; ours are those in the package or the entry point.
OUR_CODE = re.compile(r"(^|/)(dflash/|train_drafter\.py)[^ ]*\(\d+\): ")
NONE_OF_OURS = "(no function of ours open)"
# A gap's host time is sampled at points this far apart (at most HOST_SAMPLES_PER_GAP of them).
HOST_SAMPLE_US = 20.0
HOST_SAMPLES_PER_GAP = 50
BETWEEN_OPS = "(between ops: Python)"

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

    def __init__(self, out_dir: Path, start: int, steps: int, device: torch.device, enabled: bool,
                 host: bool = False):
        self.active = enabled and steps > 0 and device.type == "cuda"
        self.host = host
        self.out_dir, self.start, self.stop = out_dir / "profile", start, start + steps
        self.profiler = None

    def step_done(self, global_step: int) -> None:
        """Call after every optimizer step."""
        if not self.active:
            return
        if self.profiler is None and global_step == self.start:
            activities = [torch.profiler.ProfilerActivity.CUDA]
            if self.host:
                activities.append(torch.profiler.ProfilerActivity.CPU)
            self.profiler = torch.profiler.profile(activities=activities, with_stack=self.host)
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
        events = json.loads(trace.read_text())
        summary = summarize(gpu_timeline(events), wall_s, steps, host_timeline(events) if self.host else None)
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        gaps = summary["host_gaps"]
        logger.info("profile of %d steps: %.0f ms/step wall, GPU busy %.0f%%; GPU time by kernel family %s; "
                    "the GPU waited %.1f ms a step, most after %s (%s)", steps, 1e3 * wall_s / steps,
                    100 * summary["gpu_busy_fraction"], summary["share_of_gpu_time"], gaps["idle_ms_per_step"],
                    "; ".join(f"{g['after'][:40]} ({g['ms_per_step']} ms)" for g in gaps["largest"][:3]) or "none",
                    self.out_dir)
        if "host_during_gaps" in summary:
            for what, key in (("the host was in", "host_during_gaps"),
                              ("our innermost function was", "ours_during_gaps")):
                logger.info("while the GPU waited %s (ms a step): %s", what, "; ".join(
                    f"{name[:80]} {ms}" for name, ms in list(summary[key].items())[:5]))


def summarize(work: list[tuple[float, float, str]], wall_s: float, steps: int,
              host: list[tuple[float, float, str]] | None = None) -> dict:
    """The profile's summary from its GPU timeline (gpu_timeline) and the window's wall time; with
    the host's (host_timeline), also what the host was in while the GPU waited."""
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
        **({"host_during_gaps": host_during_gaps(work, host, steps),
            "ours_during_gaps": host_during_gaps(work, host, steps, ours=True)} if host is not None else {}),
    }


def gpu_timeline(trace: dict) -> list[tuple[float, float, str]]:
    """(start, end, name) in microseconds of each piece of GPU work in a Chrome trace, by start."""
    return sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e["name"])
                  for e in trace.get("traceEvents", [])
                  if e.get("ph") == "X" and e.get("cat") in GPU_WORK)


def host_timeline(trace: dict) -> list[tuple[float, float, str]]:
    """(start, end, name) of the host's ops on the thread that ran the most of them (the training
    loop's), by start, the enclosing op before the ops it holds."""
    ops = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in HOST_WORK]
    if not ops:
        return []
    threads = Counter(e.get("tid") for e in ops)
    main = threads.most_common(1)[0][0]
    return [(start, end, name) for start, _, end, name in sorted(
        (float(e["ts"]), -float(e.get("dur", 0.0)), float(e["ts"]) + float(e.get("dur", 0.0)),
         re.sub(r" at 0x[0-9a-f]+", "", e["name"]))  # a built-in method's object address
        for e in ops if e.get("tid") == main)]


def gpu_gaps(work: list[tuple[float, float, str]]):
    """Each stretch with no GPU work between the first start and the last end, as (start, end, the
    work that ended last before it, the work that started after it)."""
    if not work:
        return
    busy_until, last = work[0][1], work[0][2]
    for start, end, name in work[1:]:
        if start > busy_until:
            yield busy_until, start, last, name
        if end >= busy_until:
            busy_until, last = end, name


def host_during_gaps(work: list[tuple[float, float, str]], host: list[tuple[float, float, str]], steps: int,
                     top: int = 10, ours: bool = False) -> dict[str, float]:
    """Milliseconds a step of GPU idle (gaps of at least GAP_FLOOR_US) by the innermost host op or
    Python call open at the time (BETWEEN_OPS where none is: the host ran Python between recorded
    ops); sampled every HOST_SAMPLE_US of each gap. `ours`: by the innermost function of ours open
    (OUR_CODE; NONE_OF_OURS where none is), which says where in the step a library's call held it."""
    points = []
    for start, end, _, _ in gpu_gaps(work):
        if end - start >= GAP_FLOOR_US:
            n = max(1, min(HOST_SAMPLES_PER_GAP, int((end - start) / HOST_SAMPLE_US)))
            points += [(start + (i + 0.5) * (end - start) / n, (end - start) / n) for i in range(n)]
    tally: dict[str, float] = defaultdict(float)
    open_ops: list[tuple[float, str]] = []  # (end, name), innermost last
    i = 0
    for t, weight in sorted(points):
        while i < len(host) and host[i][0] <= t:
            while open_ops and open_ops[-1][0] <= host[i][0]:
                open_ops.pop()
            open_ops.append((host[i][1], host[i][2]))
            i += 1
        while open_ops and open_ops[-1][0] <= t:
            open_ops.pop()
        if ours:
            tally[next((name for _, name in reversed(open_ops) if OUR_CODE.search(name)), NONE_OF_OURS)] += weight
        else:
            tally[open_ops[-1][1] if open_ops else BETWEEN_OPS] += weight
    return {name: round(us / steps / 1e3, 3) for name, us in sorted(tally.items(), key=lambda x: -x[1])[:top]}


def idle_gaps(work: list[tuple[float, float, str]], steps: int, top: int = 10) -> dict:
    """When no stream had work: the idle time a step between the first start and the last end, and
    the gaps of at least GAP_FLOOR_US summed by where they sit (the work that ended last before
    each, and the work that started it again)."""
    if not work:
        return {"span_ms_per_step": 0.0, "idle_ms_per_step": 0.0, "largest": []}
    idle = 0.0
    sites: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for start, end, after, before in gpu_gaps(work):
        idle += end - start
        if end - start >= GAP_FLOOR_US:
            site = sites[(after[:100], before[:100])]
            site[0] += end - start
            site[1] += 1
    span = max(end for _, end, _ in work) - work[0][0]
    largest = sorted(sites.items(), key=lambda item: -item[1][0])[:top]
    return {
        "span_ms_per_step": round(span / steps / 1e3, 3),
        "idle_ms_per_step": round(idle / steps / 1e3, 3),
        "largest": [{"after": after, "before": before, "ms_per_step": round(total / steps / 1e3, 3),
                     "gaps_per_step": round(count / steps, 2)}
                    for (after, before), (total, count) in largest],
    }
