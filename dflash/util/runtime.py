"""What every command sets up first: the device (pick_device) and the log format (setup_logging:
each record carries its rank; only rank 0 speaks at INFO); the device helpers the loops share
(synchronize, HostCopy); and how training compiles what runs at every micro-batch's shape
(compile_dynamic, allow_compiled_variants).
"""

from __future__ import annotations

import logging

import torch


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible; use --device cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup_logging(rank: int) -> None:
    """Every record carries its rank; only rank 0 speaks at INFO, others at WARNING."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timing on a GPU); nothing to wait for elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_device_async(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without the host waiting for the GPU: a copy from pageable
    memory synchronizes the stream first, one from pinned memory queues behind its work."""
    if device.type == "cuda" and values.device.type == "cpu":
        values = values.pin_memory()
    return values.to(device, non_blocking=True)


class HostCopy:
    """A device tensor's values on the host without waiting for the work queued after it: copied
    into pinned memory in queue order, and waited for only when read."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._done = torch.cuda.Event() if self.cuda else None
        self._host: torch.Tensor | None = None

    def start(self, values: torch.Tensor) -> None:
        if self._host is None or self._host.shape != values.shape or self._host.dtype != values.dtype:
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=self.cuda)
        self._host.copy_(values, non_blocking=True)
        if self.cuda:
            self._done.record()

    def read(self) -> list:
        if self.cuda:
            self._done.synchronize()
        return self._host.tolist()


# A training process compiles each drafter layer (and the target's norms and MLPs) with dynamic
# shapes and still needs several variants of each: gradients on and off (training, the periodic
# eval), the first layer's input with and without grad, and shapes Inductor specializes (size-1
# dimensions; size-dependent fusion, which compile_dynamic turns off). On SmolLM2
# (`TORCH_LOGS=recompiles`) a drafter layer had 7 variants by step 1,000; at PyTorch's default
# limit of 8 the closing eval then ran flex attention eagerly. Decoding compiles the drafter's
# steps once per Decoder (per drafter judged). Past the limit PyTorch runs the function
# uncompiled: slow, not wrong.
COMPILED_VARIANTS = 32


def allow_compiled_variants(limit: int = COMPILED_VARIANTS) -> None:
    """Let each compiled function keep up to `limit` variants (never lowers a higher setting)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)


# Inductor fuses a norm's backward (row sums for the input's gradient, column sums for its weight's)
# into one "mix-order" reduction only above some sizes. Under dynamic shapes each size test is a guard,
# so a micro-batch on its other side compiles the function again, mid-run: on an H200 a 3-layer
# drafter over Qwen2.5-Coder-0.5B compiled its layers six times, three size classes (rows x positions
# under 5,852, under 40,960, above) times gradients on and off, the last pair 38 s at an epoch's end,
# where the small micro-batches are (`TORCH_LOGS=recompiles`). Non-strict mode drops the size tests:
# one variant serves every size.
SIZE_FREE_FUSION = "mix_order_reduction_non_strict_mode"


def dynamic_compile_options() -> dict:
    """Inductor options for code compiled once for every shape: no size-dependent fusion guards
    (empty where this PyTorch has no such setting)."""
    from torch._inductor import config as inductor_config
    return {f"triton.{SIZE_FREE_FUSION}": True} if hasattr(inductor_config.triton, SIZE_FREE_FUSION) else {}


def compile_dynamic(target):
    """`target` (a module, compiled in place, or a function, returned compiled) compiled once for all
    shapes: dynamic, without size-dependent fusion guards."""
    options = dynamic_compile_options()
    if isinstance(target, torch.nn.Module):
        target.compile(dynamic=True, options=options)
        return target
    return torch.compile(target, dynamic=True, options=options)
