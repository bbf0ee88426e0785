"""How many rows a batched decode of the target (dflash.target.generate) may hold on this device,
and how many prompt tokens one prefill chunk may take.

A decode over the static KV cache costs memory in three parts, besides the weights (already
resident when the free memory is measured):

    cache      = rows x capacity x KV bytes per token (every layer's keys and values, and one
                 layer's again for the gather that shrinks the batch)
    decode     = rows x (one step's activations, the attention masks over the cache, the logits
                 of the row and, when sampling, the sort behind top-k/top-p) x DECODE_COPIES
    prefill    = chunk tokens x (a forward's activations per token: the MLP's 2 x intermediate,
                 q/k/v and their RoPE copies, the mask and worst-case float32 scores over the
                 capacity) + chunk rows x the logits of their last position

A prefill of the whole batch at once would need tens of GB of MLP activations (1,024 rows of a
600-token prompt: 1.2M tokens x 19 KB of gate/up output), so prompts are prefilled in chunks of
at most `prefill_tokens` tokens, whatever the batch. The rows are what the free memory leaves
after a margin and one chunk. A pure function of the shapes (`plan_batch`), tested on CPU with
135M, 0.5B and 8B shapes; the only measurement is `free_device_bytes`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dflash.target.frozen import TargetError

# Kept free: allocator fragmentation, cuBLAS/cuDNN workspaces, CUDA graphs' own bookkeeping.
MARGIN_FRACTION = 0.10
MARGIN_BYTES = 2 * 2**30
# Live elements of one forward per token (x hidden D, x MLP width I, x q/k/v width): residuals and
# norms, gate/up and its product, q/k/v with the RoPE temporaries (counted as if all were live).
ACTIVATION_ELEMENTS = (8.0, 5.0, 6.0)
SAMPLING_BYTES_PER_LOGIT = 48  # float32 scores, sort values + int64 ids, softmax, cumsum, uniforms
# One set of decode activations lives in the CUDA graphs' pool, another in the allocator's cache
# for the stream the graphs warm up on.
DECODE_COPIES = 2
PREFILL_TOKENS_MAX = 32768  # past this a prefill matrix product gains nothing from more rows
PREFILL_FRACTION = 0.25  # of the usable memory, at most, for one prefill chunk
PREFILL_ROWS_MAX = 256  # rows per prefill chunk (each brings its last position's logits)
MAX_ROWS = 4096  # a step of more rows is no faster per row; a batch this wide drains slowly


class MemoryPlanError(TargetError):
    """Not even one row fits: what was free, what one row needs, and what to change."""


@dataclass(frozen=True)
class TargetShapes:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int

    @staticmethod
    def of(config, dtype: torch.dtype) -> "TargetShapes":
        """From an HF decoder config (head_dim defaults to hidden / heads, as in HF)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return TargetShapes(layers=config.num_hidden_layers, hidden=config.hidden_size,
                            intermediate=config.intermediate_size, heads=heads,
                            kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
                            vocab=config.vocab_size, dtype_bytes=torch.empty((), dtype=dtype).element_size())


def kv_bytes_per_token(s: TargetShapes) -> int:
    return s.layers * 2 * s.kv_heads * s.head_dim * s.dtype_bytes


def activation_bytes_per_token(s: TargetShapes) -> float:
    d, i, qkv = ACTIVATION_ELEMENTS
    return (d * s.hidden + i * s.intermediate + qkv * (s.heads + 2 * s.kv_heads) * s.head_dim) * s.dtype_bytes


def mask_bytes_per_query(s: TargetShapes, span: int) -> float:
    """A query's row of the additive mask, repeated over the query heads of a key/value head, and
    the boolean visibility it is built from (twice: with and without a sliding window)."""
    group = s.heads // s.kv_heads
    return span * ((group + 1) * s.dtype_bytes + 2)


def logits_bytes_per_row(s: TargetShapes, sampling: bool) -> float:
    return s.vocab * (s.dtype_bytes + (SAMPLING_BYTES_PER_LOGIT if sampling else 0))


def decode_bytes_per_row(s: TargetShapes, capacity: int, sampling: bool) -> float:
    """A row's cache (and one layer of it again: a shrinking batch gathers its rows a layer at a
    time), its share of a decode step (x DECODE_COPIES) and its reply buffer (int64 ids, fewer
    than the capacity)."""
    step = activation_bytes_per_token(s) + mask_bytes_per_query(s, capacity) + logits_bytes_per_row(s, sampling)
    cache = capacity * kv_bytes_per_token(s) * (1 + 1 / s.layers)
    return cache + DECODE_COPIES * step + 8 * capacity


def prefill_bytes_per_token(s: TargetShapes, capacity: int) -> float:
    """Activations, mask and worst-case float32 attention scores (a math-path SDPA) of one query."""
    return activation_bytes_per_token(s) + mask_bytes_per_query(s, capacity) + 4 * s.heads * capacity


@dataclass(frozen=True)
class BatchPlan:
    rows: int
    prefill_tokens: int  # at most this many prompt tokens per prefill forward
    prefill_rows: int  # at most this many rows per prefill forward
    peak_bytes: float  # what the model predicts the decode needs at most, beyond the weights
    report: str


def plan_batch(s: TargetShapes, free_bytes: float, capacity: int, batch_tokens: int = 0,
               sampling: bool = False) -> BatchPlan:
    """Rows of `capacity` cache columns that fit in `free_bytes` with one prefill chunk beside
    them; `batch_tokens` (rows x capacity), when set, caps the rows."""
    gib = 2**30
    usable = free_bytes * (1 - MARGIN_FRACTION) - MARGIN_BYTES
    per_token = prefill_bytes_per_token(s, capacity)
    prefill_rows = PREFILL_ROWS_MAX
    row_logits = prefill_rows * logits_bytes_per_row(s, sampling)
    budget = min(PREFILL_FRACTION * usable - row_logits, PREFILL_TOKENS_MAX * per_token)
    prefill_tokens = int(budget // per_token) // 16 * 16 if budget > 0 else 0
    prefill = prefill_tokens * per_token + row_logits
    per_row = decode_bytes_per_row(s, capacity, sampling)
    rows = int((usable - prefill) // per_row) if usable > prefill else 0
    limit = "memory"
    if rows > MAX_ROWS:
        rows, limit = MAX_ROWS, f"MAX_ROWS {MAX_ROWS}"
    if batch_tokens and batch_tokens // capacity < rows:
        rows, limit = max(1, batch_tokens // capacity), f"--batch-tokens {batch_tokens}"
    peak = rows * per_row + prefill
    report = (f"memory plan: {free_bytes / gib:.1f} GiB free, {usable / gib:.1f} usable; a row of {capacity} columns "
              f"takes {per_row / 2**20:.1f} MiB ({kv_bytes_per_token(s) / 1024:.1f} KiB of KV cache a token); "
              f"prefill chunks of {prefill_tokens} tokens take {prefill / gib:.2f} GiB -> {rows} rows "
              f"(limited by {limit}), {peak / gib:.1f} GiB at most")
    if rows < 1 or prefill_tokens < 16:
        raise MemoryPlanError(f"{report}: not even one row fits; lower --max-new-tokens, drop the longest prompts "
                              "or free the device's memory")
    return BatchPlan(rows=rows, prefill_tokens=prefill_tokens, prefill_rows=prefill_rows, peak_bytes=peak,
                     report=report)


def free_device_bytes(device: torch.device) -> float:
    """Free memory of the device, counting what our allocator holds but does not use; on a CPU,
    the memory the system reports available."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
