"""What travels between a drafter rank and a target rank: the spec both sides check at start-up,
the message layouts, and the micro-batch type the drafter receives.

Control messages are small int64 tensors on the pair's gloo group (CPU):
  hello     drafter <-> target  TransportSpec.hello(); both sides check they match
  request   drafter -> target   [REQUEST, step, n, S], then the n sample ids
  stop      drafter -> target   [STOP, -1, 0, 0]: nothing more comes from this drafter
  response  target -> drafter   [step, status, b, S, backlog, service_us]
The payload of a response is one byte message on the pair's data group (NCCL on GPUs, gloo on
CPU) whose size both sides know from (b, S): input_ids [b, S] int64, features [b, S, F],
final_hidden [b, S, D] when distillation is on, loss_mask [b, S] uint8. After a bad status
the payload is zeros of the same size, so every posted receive is matched.
backlog: tokens queued at that target by other drafters; service_us: how long the target's
last timed request took to compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PROTOCOL_VERSION = 2
REQUEST, STOP = 1, 2
STATUS_OK, STATUS_BAD_SHAPE = 0, 1
REQUEST_HEADER_LEN, RESPONSE_HEADER_LEN = 4, 6
WARMUP_BYTES = 8  # the handshake's first payload, which sets up the data channel
FEATURE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

Part = tuple[torch.dtype, tuple[int, ...]]


class TransportError(RuntimeError):
    """A peer timed out, died or broke the protocol. The message names both ranks and the step;
    `peer` is the rank at the other end where one pair failed, `timed_out` whether it went silent."""

    def __init__(self, message: str, peer: int | None = None, timed_out: bool = False) -> None:
        super().__init__(message)
        self.peer, self.timed_out = peer, timed_out


@dataclass
class FeatureBatch:
    """One micro-batch from the target to the drafter step: the samples' tokens and loss mask
    with what the target computed for them. The one type whether the target ran on this rank
    (dflash.placement.features.compute_features) or came over the transport (the server sends it,
    the client receives it)."""

    input_ids: torch.Tensor  # [b, S] int64, right padded
    loss_mask: torch.Tensor  # [b, S] bool
    features: torch.Tensor  # [b, S, F]
    final_hidden: torch.Tensor | None = None  # [b, S, D] when distillation is on
    target_rank: int | None = None  # the rank that computed it, when it came over the transport
    reused: bool = False  # the target computed it for an earlier step (a feature cache, --reuse-features)

    def to(self, device: torch.device) -> FeatureBatch:
        final = self.final_hidden.to(device) if self.final_hidden is not None else None
        return FeatureBatch(self.input_ids.to(device), self.loss_mask.to(device), self.features.to(device), final,
                            self.target_rank)


@dataclass
class TransportSpec:
    """Fixed for a run and identical on all ranks (checked at the handshake)."""

    feature_dim: int
    hidden_dim: int
    with_final_hidden: bool
    feature_dtype: torch.dtype  # of features and final_hidden on the wire
    device: torch.device  # where payloads live: cuda:local_rank (NCCL) or cpu (gloo)
    credits: int = 4
    timeout_s: float = 300.0
    watchdog_grace_s: float = 10.0  # see link.Watchdog; not part of the hello

    def __post_init__(self) -> None:
        if self.feature_dtype not in FEATURE_DTYPES:
            raise ValueError(f"feature_dtype {self.feature_dtype} is not one of {FEATURE_DTYPES}")
        if self.credits < 1 or self.timeout_s <= 0:
            raise ValueError(f"credits ({self.credits}) must be >= 1 and timeout_s ({self.timeout_s}) > 0")

    def hello(self) -> list[int]:
        return [PROTOCOL_VERSION, self.feature_dim, self.hidden_dim, int(self.with_final_hidden),
                self.credits, FEATURE_DTYPES.index(self.feature_dtype)]

    def payload_parts(self, b: int, length: int) -> list[Part]:
        """The pieces of a response payload in wire order; int64 first keeps every piece aligned."""
        parts = [(torch.int64, (b, length)), (self.feature_dtype, (b, length, self.feature_dim))]
        if self.with_final_hidden:
            parts.append((self.feature_dtype, (b, length, self.hidden_dim)))
        return [*parts, (torch.uint8, (b, length))]

    def payload_nbytes(self, b: int, length: int) -> int:
        return sum(math.prod(shape) * dtype.itemsize for dtype, shape in self.payload_parts(b, length))


def split_payload(buf: torch.Tensor, parts: list[Part]) -> list[torch.Tensor]:
    """Views of a byte message as its typed pieces."""
    out, offset = [], 0
    for dtype, shape in parts:
        size = math.prod(shape) * dtype.itemsize
        out.append(buf[offset:offset + size].view(dtype).view(shape))
        offset += size
    return out


def join_payload(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])
