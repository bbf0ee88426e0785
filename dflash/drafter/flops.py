"""One FLOP model of the work per sequence: the frozen target's forward and the drafter's
training step. Placement (`topology.suggest_target_ranks`), the training log's MFU and both
benchmarks count with it, so their figures compare.

Counted (useful work, not what a kernel happens to compute on masked tiles):
  target   forward matmuls and causal attention up to the deepest layer run
  drafter  3 x forward (forward + backward) of the trainable layers: queries (anchors x B
           slots) through every layer, context tokens through fc and the k/v projections,
           attention of each query over the context before its anchor and its own block;
           the frozen lm_head's forward + input gradient (2 x 2 x D x V) on the scored slots
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from dflash.drafter.model import head_vocab_size


@dataclass
class CostShapes:
    """What the FLOP model needs of the target and the drafter."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    target_layers_run: int  # deepest feature layer + 1, or all layers with distillation
    drafter_layers: int
    num_features: int
    anchors: int  # anchors per sequence, at most
    block_size: int
    window: int = 0  # drafter sliding window over the context (0: full)


def cost_shapes(dcfg, max_anchors: int, whole_target: bool) -> CostShapes:
    """The FLOP model's view of a drafter config (`dcfg`, with its target's shapes); the target
    runs up to its deepest feature layer, or whole with distillation (`whole_target`)."""
    layer_ids = dcfg.dflash_config["target_layer_ids"]
    return CostShapes(
        hidden=dcfg.hidden_size, intermediate=dcfg.intermediate_size, heads=dcfg.num_attention_heads,
        kv_heads=dcfg.num_key_value_heads, head_dim=dcfg.head_dim, vocab=head_vocab_size(dcfg),
        target_layers_run=dcfg.num_target_layers if whole_target else max(layer_ids) + 1,
        drafter_layers=dcfg.num_hidden_layers, num_features=len(layer_ids), anchors=max_anchors,
        block_size=dcfg.block_size, window=int(dcfg.dflash_config.get("swa_window_size", 0)),
    )


def _layer_matmul_params(s: CostShapes) -> int:
    q_o = 2 * s.hidden * s.heads * s.head_dim
    k_v = 2 * s.hidden * s.kv_heads * s.head_dim
    return q_o + k_v + 3 * s.hidden * s.intermediate


def target_flops(s: CostShapes, length: int) -> float:
    """Forward of one sequence: matmuls plus causal attention, up to the deepest layer used."""
    matmul = 2 * _layer_matmul_params(s) * length
    attention = 2 * 2 * s.heads * s.head_dim * length * length / 2
    return (matmul + attention) * s.target_layers_run


def drafter_flops(s: CostShapes, length: int, anchors: int | None = None, mean_anchor: float | None = None) -> float:
    """Forward + backward of one sequence's blocks. `anchors` defaults to as many as the length
    allows, `mean_anchor` (the mean anchor position: how much context a query sees) to length/2."""
    if anchors is None:
        anchors = min(s.anchors, max(length - 1, 1))
    if mean_anchor is None:
        mean_anchor = length / 2
    queries = anchors * s.block_size
    kv_proj = 2 * s.hidden * s.kv_heads * s.head_dim
    per_layer = 2 * _layer_matmul_params(s) * queries + 2 * kv_proj * length
    seen = min(mean_anchor, s.window) if s.window > 0 else mean_anchor
    visible = queries * (seen + s.block_size)
    per_layer += 2 * 2 * s.heads * s.head_dim * visible
    fc = 2 * s.num_features * s.hidden * s.hidden * length
    lm_head = 2 * s.hidden * s.vocab * anchors * (s.block_size - 1) * 2
    return 3 * (per_layer * s.drafter_layers + fc) + lm_head


def micro_batch_flops(s: CostShapes, lengths, anchors, with_target: bool) -> float:
    """Work of a micro-batch's sequences (true lengths, padding is not useful work)."""
    total = sum(drafter_flops(s, int(n), int(a)) for n, a in zip(lengths, anchors))
    if with_target:
        total += sum(target_flops(s, int(n)) for n in lengths)
    return total


# Dense bf16 tensor-core peak from the data sheets (TFLOP/s), by device-name fragment.
SPEC_PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "A100": 312.0, "A800": 312.0, "L40S": 362.1}


def spec_peak_tflops(device_name: str) -> float | None:
    return next((peak for key, peak in SPEC_PEAK_TFLOPS.items() if key in device_name), None)


@lru_cache(maxsize=None)
def measured_peak_tflops(device_index: int = 0, size: int = 8192, repeats: int = 20) -> float:
    """The bf16 matmul rate this GPU reaches on large square GEMMs: the ceiling our MFU is
    taken against (the data-sheet figure assumes clocks a long run does not hold)."""
    device = torch.device("cuda", device_index)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    stop.record()
    stop.synchronize()
    seconds = start.elapsed_time(stop) / 1e3
    return 2 * size**3 * repeats / seconds / 1e12
