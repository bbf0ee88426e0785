"""The regeneration batch is sized from the target's shapes and the free memory: for targets from
135M to 8B on an H200, what the memory model predicts stays under the free memory, the batch is
wide, and a prefill chunk never needs tens of GB (a whole-batch prefill of the 0.5B asked for 28
GiB in one MLP)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from dflash.target.memory import (
    MAX_ROWS,
    PREFILL_FRACTION,
    MemoryPlanError,
    TargetShapes,
    kv_bytes_per_token,
    plan_batch,
    prefill_bytes_per_token,
)

GIB = 2**30
H200 = 139 * GIB  # what the card reports as its total

QWEN3_8B = Qwen3Config(num_hidden_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, intermediate_size=12288, vocab_size=151936)
QWEN25_05B = Qwen2Config(num_hidden_layers=24, hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936)
SMOLLM2_135M = LlamaConfig(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                           intermediate_size=1536, vocab_size=49152)
# (config, bf16 weights in bytes, rows the plan must at least give at 1,024 and at 8,192 columns)
TARGETS = {"qwen3-8b": (QWEN3_8B, 16.4e9, 512, 64), "qwen2.5-0.5b": (QWEN25_05B, 0.99e9, 2048, 512),
           "smollm2-135m": (SMOLLM2_135M, 0.27e9, 2048, 256)}


def test_shapes_are_read_from_hf_configs():
    assert TargetShapes.of(QWEN3_8B, torch.bfloat16) == TargetShapes(36, 4096, 12288, 32, 8, 128, 151936, 2)
    assert TargetShapes.of(QWEN25_05B, torch.bfloat16).head_dim == 64  # hidden / heads where no head_dim is set
    small = TargetShapes.of(SMOLLM2_135M, torch.float32)
    assert (small.head_dim, small.kv_heads, small.dtype_bytes) == (64, 3, 4)
    assert kv_bytes_per_token(small) == 30 * 2 * 3 * 64 * 4


@pytest.mark.parametrize("name", TARGETS)
@pytest.mark.parametrize("capacity", [1024, 3072, 8192])
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
def test_the_plan_fits_the_free_memory_of_an_h200_with_a_wide_batch(name, capacity, sampling):
    config, weights, wide, wide_long = TARGETS[name]
    shapes = TargetShapes.of(config, torch.bfloat16)
    free = H200 - weights - 1 * GIB  # after the weights and the CUDA context
    plan = plan_batch(shapes, free, capacity, sampling=sampling)
    assert plan.peak_bytes < free
    assert plan.rows >= (wide if capacity == 1024 else wide_long) // (2 if sampling else 1), plan.report
    assert plan.rows * capacity * kv_bytes_per_token(shapes) < plan.peak_bytes  # the cache is counted
    chunk = plan.prefill_tokens * prefill_bytes_per_token(shapes, capacity)
    assert plan.prefill_tokens >= 4096 and chunk <= PREFILL_FRACTION * free
    if name == "qwen2.5-0.5b" and capacity == 1024:
        assert chunk < 8 * GIB and plan.rows == MAX_ROWS


def test_an_explicit_batch_tokens_caps_the_rows_and_the_report_says_what_limited_them():
    shapes = TargetShapes.of(QWEN25_05B, torch.bfloat16)
    free = H200 - 2 * GIB
    assert "limited by MAX_ROWS" in plan_batch(shapes, free, 1024).report
    capped = plan_batch(shapes, free, 1024, batch_tokens=524288)
    assert capped.rows == 512 and "limited by --batch-tokens 524288" in capped.report
    assert plan_batch(shapes, free, 1024, batch_tokens=100).rows == 1  # one row has to run anyway
    tight = plan_batch(shapes, 8 * GIB, 3072)
    assert 1 < tight.rows < MAX_ROWS and tight.peak_bytes < 8 * GIB and "limited by memory" in tight.report


def test_a_device_too_small_for_one_row_is_refused_with_the_way_out():
    shapes = TargetShapes.of(QWEN3_8B, torch.bfloat16)
    with pytest.raises(MemoryPlanError, match="not even one row fits; lower --max-new-tokens"):
        plan_batch(shapes, 3 * GIB, 65536)


@pytest.mark.gpu
def test_regeneration_of_a_half_billion_shaped_target_stays_inside_the_memory_it_was_given(monkeypatch):
    """On the device: the engine, told that 6 GiB are free, sizes a wide batch for a random
    Qwen2.5-0.5B-shaped target and never reserves more than that beyond the weights (the cache,
    CUDA graphs, prefill chunks and the shrinking batch all counted by the allocator)."""
    from transformers import Qwen2ForCausalLM

    import dflash.target.generate as generate
    from dflash.target.frozen import FrozenTarget

    with torch.device("cuda"):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(QWEN25_05B).to(torch.bfloat16).eval()
    target = FrozenTarget(model, [0])
    given = 6 * GIB
    monkeypatch.setattr(generate, "free_device_bytes", lambda device: given)
    generator = torch.Generator().manual_seed(0)
    prompts = {i: torch.randint(0, 151000, (int(torch.randint(50, 700, (1,), generator=generator)),),
                                generator=generator).tolist() for i in range(600)}
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    rows = []
    built = generate.ContinuousBatch

    def recording(*args, **kwargs):
        batch = built(*args, **kwargs)
        rows.append(batch.static.batch)
        return batch

    monkeypatch.setattr(generate, "ContinuousBatch", recording)
    replies = 0
    for indices, done in generate.generate_batches(target, prompts, 64, set()):
        replies += len(indices)
        assert all(len(tokens) == 64 and finish == "length" for tokens, finish in done)
    assert replies == len(prompts) and rows[0] >= 64
    assert torch.cuda.max_memory_reserved() - before < given
