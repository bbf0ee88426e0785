"""The static-cache decoder runs one matrix product for q/k/v and one for gate/up: the target's
own projections become views of those stacked rows, so no second copy of the weights is held and
HF's forward still computes the same numbers."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_target
from dflash.target.frozen import TargetError
from dflash.target.static import StaticTarget

IDS = torch.tensor([[5, 17, 3, 44, 9, 60, 2, 71]])


def test_stacked_projections_are_views_and_hf_forward_is_unchanged(arch):
    target = tiny_target(arch)
    before = target.model(IDS).logits
    static = StaticTarget(target, batch=1, capacity=32, cuda_graphs=False)
    attention, mlp = target.layers[2].self_attn, target.layers[2].mlp
    (qkv, _), (gate_up, _) = static.qkv[2], static.gate_up[2]
    assert qkv.shape[0] == sum(p.weight.shape[0] for p in (attention.q_proj, attention.k_proj, attention.v_proj))
    assert attention.q_proj.weight.data_ptr() == qkv.data_ptr(), "a view of the stacked rows, not a copy"
    assert attention.v_proj.weight.data_ptr() == qkv[-attention.v_proj.weight.shape[0]:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == gate_up[mlp.gate_proj.weight.shape[0]:].data_ptr()
    torch.testing.assert_close(target.model(IDS).logits, before, rtol=0, atol=0)
    again = StaticTarget(target, batch=2, capacity=16, cuda_graphs=False)
    assert again.qkv[2][0] is qkv and again.gate_up[2][0] is gate_up, "stacked once per model"


def test_stacking_follows_the_weights_when_the_model_moves(arch):
    """A model moved (or re-cast) after a first decoder gets its weights stacked again: the old
    stack would hold stale numbers."""
    target = tiny_target(arch)
    first = StaticTarget(target, batch=1, capacity=32, cuda_graphs=False)
    target.model.to(torch.float32)
    second = StaticTarget(target, batch=1, capacity=32, cuda_graphs=False)
    assert second.qkv[0][0] is not first.qkv[0][0] and second.qkv[0][0].dtype == torch.float32
    assert target.layers[0].self_attn.k_proj.weight.data_ptr() == \
        second.qkv[0][0][target.layers[0].self_attn.q_proj.weight.shape[0]:].data_ptr()


def test_projections_with_and_without_bias_are_refused_with_the_way_out():
    target = tiny_target("llama")
    q_proj = target.layers[0].self_attn.q_proj
    q_proj.bias = torch.nn.Parameter(torch.zeros(q_proj.out_features, dtype=q_proj.weight.dtype))
    with pytest.raises(TargetError, match="some of its projections have a bias and some do not.*--decoder plain"):
        StaticTarget(target, batch=1, capacity=32, cuda_graphs=False)


def test_batched_generation_sizes_each_cache_to_its_prompts_and_keeps_greedy_tokens(monkeypatch):
    """Short prompts get more rows per batch than the longest one would allow; every reply
    stays the target's greedy reply."""
    import dflash.target.generate as generate
    from dflash.eval.speculative import greedy_decode

    monkeypatch.setattr(generate, "CAPACITY_STEP", 16)
    target = tiny_target("llama", dtype=torch.float32)
    prompts = {0: list(range(3, 40)), 1: list(range(5, 41)), 2: [7, 8, 9], 3: [11, 2], 4: [4, 4, 4, 4], 5: [9]}
    sizes = []
    built = generate.StaticTarget

    def recording(*args, **kwargs):
        static = built(*args, **kwargs)
        sizes.append((static.batch, static.capacity))
        return static

    monkeypatch.setattr(generate, "StaticTarget", recording)
    replies = {}
    for indices, rows in generate.generate_batches(target, prompts, 8, set(), batch_tokens=100):
        replies.update(zip(indices, rows))
    assert sizes == [(2, 48), (4, 16)]  # 100 // (40 + 8 -> 48) rows, then 100 // (4 + 8 -> 16), capped by what is left
    assert replies == {i: greedy_decode(target, p, 8, set()).tokens for i, p in prompts.items()}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_batched_generation_drops_finished_rows_and_keeps_greedy_tokens(device, monkeypatch):
    """Rows whose reply has ended leave the batch (their cache rows move out, the live ones to
    the front, CUDA graphs captured again for the smaller batch); every reply stays the target's
    greedy reply up to its first stop token."""
    import dflash.target.generate as generate
    from dflash.eval.speculative import greedy_decode

    monkeypatch.setattr(generate, "STOP_CHECK_EVERY", 2)
    monkeypatch.setattr(generate, "ROW_STEP", 1)
    target = tiny_target("llama", dtype=torch.float32)
    target.model.to(device)
    prompts = {i: [3 + i, 7, 11 + 2 * i, 5 + i][: 2 + i % 3] for i in range(7)}  # 2-4 tokens: left padding differs
    free = {i: greedy_decode(target, p, 24, set()).tokens for i, p in prompts.items()}
    stop_ids = {free[0][3], free[4][9]}
    expected = {i: tokens[: next((k for k, t in enumerate(tokens) if t in stop_ids), len(tokens))]
                for i, tokens in free.items()}
    lengths = sorted(map(len, expected.values()))
    assert lengths[0] <= 3 < lengths[-1], "the stop tokens must end some replies early and not others"
    kept = []
    keep_rows = StaticTarget.keep_rows

    def recording(self, rows):
        kept.append(len(rows))
        keep_rows(self, rows)

    monkeypatch.setattr(StaticTarget, "keep_rows", recording)
    replies = {}
    for indices, rows in generate.generate_batches(target, prompts, 24, stop_ids, batch_tokens=10_000):
        replies.update(zip(indices, rows))
    assert replies == expected
    assert kept and kept == sorted(kept, reverse=True) and kept[-1] < len(prompts)


def test_decode_attention_alternatives_compute_what_the_static_target_calls():
    """dflash.benchmarks.decode_attention times other kernels against StaticTarget's SDPA call;
    they must give the same output (rows that see different numbers of columns)."""
    from dflash.benchmarks.decode_attention import compare

    rows = compare([(5, 40), (3, 17)], kv_heads=2, group=3, head_dim=8, device=torch.device("cpu"),
                   dtype=torch.float32, repeats=1)
    assert {r["implementation"] for r in rows} == {"sdpa (StaticTarget)", "matmul + softmax"}
    assert all(r["max_abs_diff"] < 1e-5 and r["ms"] > 0 for r in rows)



def test_the_regeneration_step_benchmark_times_and_profiles_a_step():
    from dflash.benchmarks.regen_step import parse_shapes, time_steps

    result = time_steps(tiny_target("llama", dtype=torch.float32), 3, 40, 20, steps=2, profile=True)
    assert result["capacity"] == 48 and result["ms_per_step"] > 0 and result["row_steps_per_second"] > 0
    assert "aten::scaled_dot_product_attention" in result["profile"]
    assert parse_shapes("4x64x32,2x512x500") == [(4, 64, 32), (2, 512, 500)]
    with pytest.raises(SystemExit, match="prompt \\+ 8 <= capacity"):
        parse_shapes("4x64x60")
