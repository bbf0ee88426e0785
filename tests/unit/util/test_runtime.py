"""dflash.util.runtime: a training process lets its compiled functions keep more variants than
PyTorch's default, past which they would silently run uncompiled."""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounter

from dflash.util.runtime import COMPILED_VARIANTS, allow_compiled_variants


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
