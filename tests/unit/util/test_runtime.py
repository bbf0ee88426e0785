"""dflash.util.runtime: a training process lets its compiled functions keep more variants than
PyTorch's default, past which they would silently run uncompiled, and compiles what runs at every
micro-batch's shape without size-dependent fusion guards (tests/unit/drafter/test_gpu.py shows the
recompiles they caused are gone)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from dflash.util.runtime import (COMPILED_VARIANTS, allow_compiled_variants, compile_dynamic, dynamic_compile_options,
                                  to_device_async)


def compiled_shapes(shapes: int) -> int:
    """Calls one compiled function at `shapes` different static shapes; returns how many were compiled."""
    torch._dynamo.reset()
    counter = CompileCounter()
    double = torch.compile(lambda x: x * 2, backend=counter, dynamic=False)
    for n in range(1, shapes + 1):
        double(torch.ones(n))
    return counter.frame_count


def test_compiled_functions_keep_more_variants_than_the_default_limit(monkeypatch):
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    assert compiled_shapes(12) == 8  # PyTorch's default: the last 4 shapes ran uncompiled
    allow_compiled_variants()
    assert torch._dynamo.config.recompile_limit == COMPILED_VARIANTS
    assert compiled_shapes(12) == 12
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 100)
    allow_compiled_variants()  # a user's higher setting stays
    assert torch._dynamo.config.recompile_limit == 100
    torch._dynamo.reset()


def test_code_compiled_for_every_shape_asks_inductor_for_size_free_fusion():
    """The pinned PyTorch has the setting (were it renamed, compiles would silently guard on sizes
    again), and Inductor accepts the options: it checks their names when it wraps a function or module."""
    assert dynamic_compile_options() == {"triton.mix_order_reduction_non_strict_mode": True}
    layer = compile_dynamic(torch.nn.Linear(2, 2))
    assert isinstance(layer, torch.nn.Linear)
    assert callable(compile_dynamic(lambda x: x * 2))


def test_a_host_tensor_copied_asynchronously_keeps_its_values():
    values = torch.randn(4, 5)
    assert torch.equal(to_device_async(values, torch.device("cpu")), values)


@pytest.mark.gpu
def test_on_a_gpu_a_host_tensor_reaches_the_device_without_the_host_waiting_for_queued_work():
    """With matmuls queued for a while, the copy returns while they still run (a copy from
    pageable memory would wait for them), and the values arrive intact behind them."""
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    for _ in range(500):  # about a second on an H100
        a = a @ a / 64
    values = torch.randn(1000, 1000)
    on_device = to_device_async(values, torch.device("cuda"))
    assert not torch.cuda.current_stream().query(), "the host waited for the queued matmuls"
    assert torch.equal(on_device.cpu(), values)
