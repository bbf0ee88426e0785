"""The profile's summary from a Chrome trace: GPU time by kernel family, and where the GPU waited."""

import pytest

from dflash.training.profiling import (BETWEEN_OPS, GAP_FLOOR_US, NONE_OF_OURS, gpu_timeline, host_timeline,
                                      summarize)


def kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}


def two_steps_trace():
    """Two steps of: a GEMM, an Adam kernel, a copy on another stream inside it, then a gap before
    the next step's GEMM; a 5 us gap between GEMM and Adam stays under the floor. CPU ops and
    runtime calls are no GPU work."""
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1, "dur": 3}]
    for step in range(2):
        t = step * 1000.0
        events += [kernel("nvjet_gemm", t, 300),
                   kernel("multi_tensor_apply_kernel<adam>", t + 305, 100),
                   kernel("Memcpy DtoD", t + 350, 100, cat="gpu_memcpy")]
    return {"traceEvents": events[::-1]}  # out of order, as a trace may be


def test_the_timeline_holds_only_gpu_work_in_start_order():
    work = gpu_timeline(two_steps_trace())
    assert [name for _, _, name in work] == ["nvjet_gemm", "multi_tensor_apply_kernel<adam>", "Memcpy DtoD"] * 2
    assert work[1] == (305.0, 405.0, "multi_tensor_apply_kernel<adam>")


def test_the_summary_finds_the_step_boundary_gap_and_the_families():
    summary = summarize(gpu_timeline(two_steps_trace()), wall_s=0.002, steps=2)
    gaps = summary["host_gaps"]
    # the GPU is idle 5 us (GEMM -> Adam) in each step and 1000 - 450 = 550 us between the steps
    assert gaps["span_ms_per_step"] == pytest.approx(1450 / 2 / 1e3)
    assert gaps["idle_ms_per_step"] == pytest.approx((5 + 550 + 5) / 2 / 1e3)
    assert gaps["largest"] == [{"after": "Memcpy DtoD", "before": "nvjet_gemm", "ms_per_step": 0.275,
                                "gaps_per_step": 0.5}]
    assert 5 < GAP_FLOOR_US < 550
    assert summary["share_of_gpu_time"] == {"matmul": 0.6, "optimizer": 0.2, "copy": 0.2}
    assert summary["gpu_busy_s_per_step"] == pytest.approx(500e-6)
    assert summary["gpu_busy_fraction"] == pytest.approx(1000e-6 / 0.002)


def host_op(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def test_the_host_op_open_while_the_gpu_waits_is_named_innermost_first():
    """One step: kernels [0, 10) and [110, 120), a 100 us gap sampled at 20, 40, 60, 80, 100. The
    training thread is in `step` over [0, 90) and in aten::nonzero over [20, 60): the samples at 20
    and 40 fall in nonzero, 60 (where nonzero has ended) and 80 in `step`, 100 (after `step`)
    between ops. Another thread's op, and ops outside the gap, count for nothing."""
    events = [kernel("gemm", 0, 10), kernel("adam", 110, 10),
              host_op("step", 0, 90, cat="user_annotation"), host_op("aten::nonzero", 20, 40),
              host_op("aten::mm", 0, 5), host_op("aten::add", 112, 3),
              host_op("pin_memory", 15, 100, tid=2)]
    trace = {"traceEvents": events[::-1]}
    host = host_timeline(trace)
    assert [name for _, _, name in host] == ["step", "aten::mm", "aten::nonzero", "aten::add"]
    summary = summarize(gpu_timeline(trace), wall_s=120e-6, steps=1, host=host)
    assert summary["host_during_gaps"] == {"aten::nonzero": 0.04, "step": 0.04, BETWEEN_OPS: 0.02}
    assert "host_during_gaps" not in summarize(gpu_timeline(trace), wall_s=120e-6, steps=1)


def test_the_python_calls_open_while_the_gpu_waits_name_the_library_call_and_our_function_within():
    """With Python calls recorded (--profile-host), the same 100 us gap: `main` of the entry point over
    [0, 115), our `backward_and_step` over [0, 100), DeepSpeed's `step` (a library) over [30, 90)
    and aten::item over [50, 70). Innermost: 20 in ours, 40 and 80 in DeepSpeed's, 60 in the op,
    100 in `main`; by our innermost function: 20-80 in `backward_and_step`, 100 in `main`."""
    ours, library = "/tmp/code/dflash/training/run.py(404): backward_and_step", "deepspeed/runtime/engine.py(2150): step"
    entry = "train_drafter.py(12): main"
    events = [kernel("gemm", 0, 10), kernel("adam", 110, 10),
              host_op(entry, 0, 115, cat="python_function"), host_op(ours, 0, 100, cat="python_function"),
              host_op(library, 30, 60, cat="python_function"), host_op("aten::item", 50, 20),
              host_op("<built-in method item of Tensor object at 0x7fb2c0c8c4d0>", 112, 2, cat="python_function")]
    host = host_timeline({"traceEvents": events})
    assert host[-1][2] == "<built-in method item of Tensor object>"  # addresses dropped: one name per method
    summary = summarize(gpu_timeline({"traceEvents": events}), wall_s=120e-6, steps=1, host=host)
    assert summary["host_during_gaps"] == {library: 0.04, ours: 0.02, "aten::item": 0.02, entry: 0.02}
    assert summary["ours_during_gaps"] == {ours: 0.08, entry: 0.02}
    outside = [host_op(library, 0, 115, cat="python_function")]
    assert summarize(gpu_timeline({"traceEvents": events[:2] + outside}), wall_s=120e-6, steps=1,
                     host=host_timeline({"traceEvents": outside}))["ours_during_gaps"] == {NONE_OF_OURS: 0.1}


def test_profile_host_needs_the_profile_window(tmp_path):
    from dflash.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="--profile-steps"):
        parse_config(["--profile-host", "true", "--output-dir", str(tmp_path)])
    config = parse_config(["--profile-host", "true", "--profile-steps", "2", "--output-dir", str(tmp_path)])
    assert config.train.profile_host and config.train.profile_steps == 2


def test_an_empty_window_has_no_gaps_and_instant_work_no_share():
    summary = summarize([], wall_s=0.1, steps=3)
    assert summary["host_gaps"] == {"span_ms_per_step": 0.0, "idle_ms_per_step": 0.0, "largest": []}
    assert summarize([(5.0, 5.0, "memset")], wall_s=0.1, steps=1)["share_of_gpu_time"] == {"copy": 0.0}


@pytest.mark.gpu
def test_a_cuda_profile_window_writes_a_summary_with_the_kernels_and_the_host_gap(tmp_path):
    """On a GPU: the profiler (GPU activity alone) sees the matmuls of each step, and a host sleep
    between steps shows as an idle gap after the step's last kernel."""
    import json
    import time

    import torch

    from dflash.training.profiling import StepProfiler

    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    a = torch.randn(2048, 2048, device="cuda")
    profiler = StepProfiler(tmp_path, start=1, steps=2, device=torch.device("cuda"), enabled=True)
    for step in range(1, 4):
        profiler.step_done(step)
        for _ in range(4):
            a = torch.tanh(a @ a)
        time.sleep(0.02)  # the host keeps the GPU waiting
    summary = json.loads((tmp_path / "profile" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["share_of_gpu_time"].get("matmul", 0) > 0.3
    gaps = summary["host_gaps"]
    assert gaps["idle_ms_per_step"] > 5 and gaps["largest"], gaps


@pytest.mark.gpu
def test_on_a_gpu_the_host_profile_names_what_the_host_did_while_the_gpu_waited(tmp_path):
    """With the host's ops and Python calls recorded, a Python sleep between steps shows up in
    host_during_gaps by name, and the GPU work is still all there."""
    import json
    import time

    import torch

    from dflash.training.profiling import StepProfiler

    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    a = torch.randn(2048, 2048, device="cuda")
    profiler = StepProfiler(tmp_path, start=1, steps=2, device=torch.device("cuda"), enabled=True, host=True)
    for step in range(1, 4):
        profiler.step_done(step)
        for _ in range(4):
            a = torch.tanh(a @ a)
        time.sleep(0.05)  # Python keeps the GPU waiting, far longer than the matmuls queued before it run
    summary = json.loads((tmp_path / "profile" / "summary.json").read_text())
    assert summary["share_of_gpu_time"].get("matmul", 0) > 0.3
    during = summary["host_during_gaps"]  # the Python calls recorded too: the sleep itself is named
    assert sum(ms for name, ms in during.items() if "sleep" in name) > 10, during
    assert summary["ours_during_gaps"].get(NONE_OF_OURS, 0) > 10, summary["ours_during_gaps"]  # a test's code
