"""How many draft positions a drafter micro-batch may hold on this GPU.

A drafter micro-batch costs memory in two units: context tokens (the target's features, the
fused context and its keys/values in every layer) and draft positions (anchors x B query
slots: every drafter layer's saved activations, the lm_head's input and gradient). With the
recipe's 512 anchors x 16, a 2,000-token sequence brings 8,192 draft positions, so draft
positions dominate and a budget in context tokens alone does not bound memory.

    fixed      = drafter weights + gradients (bf16) + fp32 master weights and AdamW moments
                 (ZeRO: divided over the drafter ranks) + the lm_head loss chunk + a reserve
    per token  = BYTES_PER_CONTEXT_TOKEN(shapes)
    per slot   = BYTES_PER_DRAFT_POSITION(shapes)

The budget is what the free memory (measured after the target loaded) leaves after `fixed` and
a full `--max-tokens` of context. The per-unit constants are element counts per layer, checked
against measured peaks on an H200 (BENCHMARKS.md, `python -m dflash.benchmarks.step --memory-sweep`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Saved activations per draft position and drafter layer, in elements of the hidden size D and
# the MLP width I (norms keep float32 copies, hence the large D count), and per context token.
# Fitted to the H200 memory sweep (compiled layers, fused loss): 741 KB per draft position and
# 148 KB per context token for Qwen3-8B shapes; these give 762 KB and 156 KB (a little above).
DRAFT_ELEMENTS_PER_LAYER = (9.0, 3.0)  # (x D, x I), 2 bytes each
EAGER_DRAFT_ELEMENTS_PER_LAYER = (24.0, 4.0)  # naive kernels: eager norms keep float32 copies
CONTEXT_ELEMENTS_PER_LAYER_KV = 8.0  # x kv width, 2 bytes each (keys, values, norm and RoPE copies)
CONTEXT_ELEMENTS = 4.0  # x D: fc output, hidden norm
WORKSPACE_BYTES = 2**30  # RoPE tables, masks, kernel workspaces
RESERVE_FRACTION = 0.08  # allocator fragmentation
LOSS_CHUNK = 4096


@dataclass
class MemoryShapes:
    hidden: int
    intermediate: int
    kv_width: int  # kv heads x head dim
    layers: int
    num_features: int
    vocab: int
    anchors: int
    block_size: int


def bytes_per_draft_position(s: MemoryShapes, fast: bool = True) -> float:
    """`fast`: compiled layers and the fused loss; else eager layers and full logits."""
    d_count, i_count = DRAFT_ELEMENTS_PER_LAYER if fast else EAGER_DRAFT_ELEMENTS_PER_LAYER
    per_layer = (d_count * s.hidden + i_count * s.intermediate) * 2
    loss = 3 * s.hidden * 2  # selected hidden, its gradient, the final norm's input
    if not fast:  # autograd keeps bf16 logits, their float32 copy and the log-softmax
        loss += s.vocab * (2 + 4 + 4) * (s.block_size - 1) / s.block_size
    return s.layers * per_layer + loss


def bytes_per_context_token(s: MemoryShapes) -> float:
    features = s.num_features * s.hidden * 2
    return features + CONTEXT_ELEMENTS * s.hidden * 2 + s.layers * CONTEXT_ELEMENTS_PER_LAYER_KV * s.kv_width * 2


def drafter_state_bytes(params: int, zero_stage: int, drafter_ranks: int) -> float:
    """bf16 weights and gradients on every rank; fp32 master weights, moments and the fp32
    gradient partition sharded by ZeRO (stage 2 also shards the bf16 gradients)."""
    grads = 2 * params / (drafter_ranks if zero_stage >= 2 else 1)
    return 2 * params + grads + 16 * params / drafter_ranks


def loss_workspace_bytes(s: MemoryShapes) -> float:
    return LOSS_CHUNK * s.vocab * (4 + 2)  # one chunk's float32 logits and bf16 probabilities


@dataclass
class Budget:
    max_draft_positions: int
    report: str


class MemoryBudgetError(ValueError):
    """Even one sequence does not fit."""


def draft_position_budget(s: MemoryShapes, available_bytes: float, params: int, zero_stage: int,
                          drafter_ranks: int, max_tokens: int, fast: bool = True) -> Budget:
    gib = 2**30
    fixed = drafter_state_bytes(params, zero_stage, drafter_ranks) + loss_workspace_bytes(s) + WORKSPACE_BYTES
    reserve = RESERVE_FRACTION * available_bytes
    context = max_tokens * bytes_per_context_token(s)
    per_position = bytes_per_draft_position(s, fast)
    left = available_bytes - fixed - reserve - context
    positions = int(left // per_position) if left > 0 else 0
    one_sequence = s.anchors * s.block_size
    report = (f"memory model: {available_bytes / gib:.1f} GiB free after the target = drafter state "
              f"{drafter_state_bytes(params, zero_stage, drafter_ranks) / gib:.1f} + loss chunk "
              f"{loss_workspace_bytes(s) / gib:.1f} + workspace {WORKSPACE_BYTES / gib:.1f} + reserve {reserve / gib:.1f} + {max_tokens} context tokens "
              f"{context / gib:.1f} + draft positions at {per_position / 2**20:.2f} MiB each -> "
              f"--max-draft-positions {positions} ({positions / one_sequence:.1f} sequences of "
              f"{s.anchors} anchors x {s.block_size})")
    if positions < one_sequence:
        raise MemoryBudgetError(
            f"{report}: not even one sequence fits; lower --max-anchors or --max-tokens, use ZeRO-2 "
            f"(--deepspeed-config ds_configs/zero2.json) or more drafter ranks, or put the target on its "
            f"own ranks (--target-ranks)")
    return Budget(positions, report)


def free_device_bytes(device: torch.device) -> float:
    """Free memory of the device, counting what our allocator holds but does not use."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
