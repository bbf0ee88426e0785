"""The static-cache decoder runs one matrix product for q/k/v and one for gate/up: the target's
own projections become views of those stacked rows, so no second copy of the weights is held and
HF's forward still computes the same numbers."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from conftest import tiny_target
from dflash.nn.transformer import attend
from dflash.target.frozen import TargetError
from dflash.target.static import StaticTarget, round_up

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


def greedy_replies(target, prompts: dict[int, list[int]], max_new_tokens: int) -> dict[int, list[int]]:
    """One prompt at a time, HF's forward."""
    from dflash.eval.speculative import greedy_decode

    return {i: greedy_decode(target, prompt, max_new_tokens, set()).tokens for i, prompt in prompts.items()}


def ended(tokens: list[int], stop_ids: set[int]) -> tuple[list[int], str]:
    """A reply as the engine gives it: up to and including its first stop token."""
    stop = next((k for k, t in enumerate(tokens) if t in stop_ids), None)
    return (tokens, "length") if stop is None else (tokens[:stop + 1], "stop")


def batched_replies(target, prompts, max_new_tokens, stop_ids, **kwargs) -> dict:
    from dflash.target.generate import generate_batches

    replies = {}
    for indices, rows in generate_batches(target, prompts, max_new_tokens, stop_ids, **kwargs):
        assert not set(indices) & set(replies), "each reply comes once"
        replies.update(zip(indices, rows))
    return replies


def test_caches_follow_the_prompt_lengths_a_smaller_one_once_it_holds_twice_the_rows(monkeypatch):
    import dflash.target.generate as generate

    monkeypatch.setattr(generate, "CAPACITY_STEP", 16)
    rows_at = {64: 2, 48: 4, 32: 6, 16: 9}.__getitem__  # rows a cache of that many columns holds
    # prompt + 8 new tokens + 16 (the steps before a check), rounded up to 16 columns
    assert generate.phases([40, 38, 20, 17, 8, 5, 1], 8, rows_at) == [(64, 2), (48, 5)]
    assert generate.phases([8, 1], 8, rows_at) == [(32, 2)]  # 6 rows, then 25 columns -> 32 again
    assert generate.phases([], 8, rows_at) == []


def test_prefill_chunks_hold_at_most_the_planned_tokens_and_rows():
    from dflash.target.generate import prefill_chunks

    assert prefill_chunks([40, 33, 20, 3, 1], max_tokens=96, max_rows=3) == [
        (0, 2, [(0, 48)]), (2, 5, [(0, 32)])]  # 2 x 48 padded tokens, then 3 x 32
    assert prefill_chunks([70, 5], max_tokens=32, max_rows=8) == [(0, 1, [(0, 32), (32, 64), (64, 80)]),
                                                                 (1, 2, [(0, 16)])]


def test_chunked_prefill_gives_the_one_shot_prefills_cache_and_tokens(arch):
    """A prompt prefilled in column windows, into chosen rows, leaves the cache and the next
    token a one-shot prefill of it alone gives (float32)."""
    target = tiny_target(arch, dtype=torch.float32)
    prompts = [list(range(3, 40)), [9, 4, 17, 2, 60, 5, 33, 8, 1, 70, 12, 6, 44, 3, 90, 7, 15, 2, 22, 31]]
    width = 48
    ids = torch.zeros(2, width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = torch.tensor(prompt)
    last = torch.tensor([len(p) - 1 for p in prompts])
    rows = torch.tensor([2, 0])  # into rows 2 and 0 of a 3-row cache
    chunked = StaticTarget(target, batch=3, capacity=64, cuda_graphs=False)
    choice = None
    for start in range(0, width, 16):
        step = chunked.extend_rows(ids[:, start:start + 16], rows, start, (last - start).clamp(0, 15))
        inside = ((last >= start) & (last < start + 16))[:, None]
        choice = step if choice is None else torch.where(inside, step, choice)
    for row, prompt in zip(rows.tolist(), prompts):
        alone = StaticTarget(target, batch=1, capacity=64, cuda_graphs=False)
        want, _ = alone.prefill(torch.tensor([prompt]))
        assert choice[[2, 0].index(row)].tolist() == want[0].tolist()
        for cache, reference in ((chunked.keys, alone.keys), (chunked.values, alone.values)):
            torch.testing.assert_close(cache[:, row, :, :len(prompt)], reference[:, 0, :, :len(prompt)],
                                       rtol=1e-5, atol=1e-5)
    one_shot = StaticTarget(target, batch=3, capacity=64, cuda_graphs=False)
    assert one_shot.extend_rows(ids, rows, 0, last).tolist() == choice.tolist()


def test_the_cache_write_inside_the_projection_leaves_what_the_separate_write_does(arch, monkeypatch):
    """Graphed batch-1 steps write k and v inside the (compiled) projection, with index_copy_ at the
    columns every row shares; here the parts run eagerly (float64): the choices, features and whole
    caches must be those of the separate scatter after each of a few steps."""
    import dflash.target.static as static

    monkeypatch.setattr(static, "_compiled_parts", (static.project_qkv, static.project_and_write, static.finish_layer))
    target = tiny_target(arch)
    separate, inside = (StaticTarget(target, batch=2, capacity=64, cuda_graphs=False) for _ in range(2))
    ids = torch.tensor([[5, 17, 3, 44, 9, 60, 2, 71], [8, 1, 90, 12, 13, 6, 2, 4]])
    for cache in (separate, inside):
        cache.prefill(ids)
    for start in (8, 11, 14):
        block = torch.tensor([[7, 11, 13], [3, 3, 50]])
        outputs = []
        for cache, shared in ((separate, False), (inside, True)):
            cache._at(start, block)
            outputs.append(cache._forward(block, cache._shared_columns(block.shape), 64, features=True,
                                          compiled=True, shared=shared))
        (choice, features), (want, want_features) = outputs[1], outputs[0]
        assert choice.tolist() == want.tolist()
        torch.testing.assert_close(features, want_features, rtol=1e-12, atol=1e-12)
        for got, reference in ((inside.keys, separate.keys), (inside.values, separate.values)):
            torch.testing.assert_close(got, reference, rtol=1e-12, atol=1e-12)
    assert inside.keys[:, :, :, 17:].abs().sum() == 0, "nothing written past the steps' columns"


@pytest.mark.gpu
def test_compiled_graphed_steps_give_the_eager_steps_choices_features_and_caches(arch):
    """On a GPU the graphed steps run compiled layer parts (the cache write inside the projection,
    the residual addition in the next layer's): one token and blocks of 4, against eager steps."""
    target = tiny_target(arch, dtype=torch.float32)
    target.model.cuda()
    compiled = StaticTarget(target, batch=1, capacity=64, compiled=True)
    eager = StaticTarget(target, batch=1, capacity=64, cuda_graphs=False)
    assert compiled.compiled and compiled.graphs.enabled
    ids = torch.tensor([[5, 17, 3, 44, 9, 60, 2, 71, 30]], device="cuda")
    (choice, _), (want, _) = compiled.prefill(ids), eager.prefill(ids)
    assert choice.tolist() == want.tolist()
    at = ids.shape[1]
    for width in (1, 4, 1, 4):
        block = torch.cat([want[:, -1:], torch.tensor([[7, 11, 13]], device="cuda")[:, :width - 1]], dim=1)
        (choice, features), (want, want_features) = compiled.step(block, at), eager.step(block, at)
        assert choice.tolist() == want.tolist()
        torch.testing.assert_close(features, want_features, rtol=1e-4, atol=1e-4)
        at += width
    torch.testing.assert_close(compiled.keys[:, :, :, :at], eager.keys[:, :, :, :at], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(compiled.values[:, :, :, :at], eager.values[:, :, :, :at], rtol=1e-4, atol=1e-4)


def test_fresh_prompts_prefill_causally_without_a_mask_and_give_hfs_features_and_tokens(arch, monkeypatch):
    """Prompts entering rows at column 0 attend over themselves with SDPA's causal kernel (no
    dense mask is built or read): right-padded rows of different lengths give, at their real
    positions, the features and next token of HF's forward over each prompt alone (float64)."""
    import dflash.target.static as static

    target = tiny_target(arch)
    masked = []
    monkeypatch.setattr(static, "attend", lambda *args: masked.append(args) or attend(*args))
    prompts = [[5, 17, 3, 44, 9, 60, 2, 71, 30, 8, 1, 90, 12], [60, 2, 2, 71, 30]]
    ids = torch.zeros(2, 16, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = torch.tensor(prompt)
    last = torch.tensor([len(p) - 1 for p in prompts])
    session = StaticTarget(target, batch=2, capacity=32, cuda_graphs=False)
    choice, features = session._forward(ids, session._shared_columns(ids.shape), None, last=last, features=True)
    assert not masked, "a fresh prompt's prefill must not take the masked path"
    for row, prompt in enumerate(prompts):
        alone = torch.tensor([prompt])
        want = target.features(alone, with_final_hidden=True)
        torch.testing.assert_close(features[row, :len(prompt)], want.features[0])
        assert choice[row, 0].item() == target.model(alone).logits[0, -1].argmax().item()
    session.step_rows(torch.tensor([[7], [11]]), last + 1, int(last.max()) + 2)
    assert masked, "steps over the cache attend under the mask"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_padded_prefill_decodes_what_the_prompt_alone_does(arch, device):
    """Prompts padded to a multiple of 16 (a CUDA graph per padded length on a GPU, captured with
    the steps' beforehand on zeros): the choice, the prompt's features and every later step's match
    a prefill of the prompt alone (float64), while the padding's columns were written and stale
    tokens from a longer prompt fill them."""
    target = tiny_target(arch)
    target.model.to(device)
    padded = StaticTarget(target, batch=1, capacity=64, prefill_step=16)
    assert padded.graphs.enabled == (device == "cuda")
    for prompt in ([5, 17, 3, 44, 9, 60, 2, 71, 30, 8, 1, 90, 12, 13, 6, 2, 4, 40, 41], [60, 2, 2, 71, 30, 8, 1]):
        alone = StaticTarget(target, batch=1, capacity=64, cuda_graphs=False, prefill_step=0)
        ids = torch.tensor([prompt], device=device)
        padded.prepare(len(prompt), 3, len(prompt) + 12)
        assert padded.graphs.enabled == ((3, 64) in padded.graphs), "the steps' graph captured beforehand"
        (choice, features), (want, want_features) = padded.prefill(ids), alone.prefill(ids)
        assert choice.tolist() == want.tolist()
        torch.testing.assert_close(features, want_features, rtol=1e-10, atol=1e-10)
        written = padded.keys[:, 0, :, len(prompt):round_up(len(prompt), 16)]
        assert written.abs().sum() > 0 and alone.keys[:, 0, :, len(prompt):].abs().sum() == 0
        for at in range(len(prompt), len(prompt) + 12, 3):  # steps of 3 tokens, each chosen from the last
            block = torch.cat([choice[:, -1:].clone(), torch.tensor([[7, 11]], device=device)], dim=1)
            (choice, features), (want, want_features) = padded.step(block, at), alone.step(block, at)
            assert choice.tolist() == want.tolist()
            torch.testing.assert_close(features, want_features, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_continuous_batching_refills_ended_rows_and_keeps_each_prompts_greedy_reply(device, monkeypatch, caplog):
    """4 rows for 13 prompts: a row whose reply ended takes the next prompt while the others go
    on (rows at different columns, prefilled in chunks of 16 tokens and 2 rows), the rows left
    without a prompt leave the batch, and every reply is the prompt's own greedy reply, with the
    stop token that ended it ("stop") or cut at max_new_tokens ("length")."""
    import dflash.target.generate as generate
    import dflash.target.memory as memory

    caplog.set_level(logging.INFO, logger="dflash.target.generate")
    monkeypatch.setattr(generate, "CAPACITY_STEP", 16)
    monkeypatch.setattr(generate, "ROW_STEP", 1)
    monkeypatch.setattr(memory, "PREFILL_TOKENS_MAX", 16)
    monkeypatch.setattr(memory, "PREFILL_ROWS_MAX", 2)
    target = tiny_target("llama", dtype=torch.float32)
    target.model.to(device)
    prompts = {i: [3 + i, 7, 11 + 2 * i, 5 + i, 9, 1, 2, 8, 4, 6, 10, 12, 13, 14, 15, 16, 17, 18][: 2 + (5 * i) % 17]
               for i in range(13)}
    free = greedy_replies(target, prompts, 30)
    stop_ids = {free[0][3], free[4][9]}
    expected = {i: ended(tokens, stop_ids) for i, tokens in free.items()}
    reasons = [finish for _, finish in expected.values()]
    assert 3 < reasons.count("stop") < 13, "the stop tokens must end some replies early and not others"
    fills, kept = [], []
    fill, keep_rows = generate.ContinuousBatch.fill, StaticTarget.keep_rows

    def recording_fill(self, slots, indices, prompts):
        fills.append((len(slots), int(self.host_live.sum())))
        fill(self, slots, indices, prompts)

    def recording_keep(self, rows):
        kept.append(len(rows))
        keep_rows(self, rows)

    monkeypatch.setattr(generate.ContinuousBatch, "fill", recording_fill)
    monkeypatch.setattr(StaticTarget, "keep_rows", recording_keep)
    assert batched_replies(target, prompts, 30, stop_ids, batch_tokens=4 * 64) == expected
    assert fills[0] == (4, 0) and sum(n for n, _ in fills) == 13
    assert any(0 < n and live > 0 for n, live in fills[1:]), "a row was refilled while others were decoding"
    assert kept and kept == sorted(kept, reverse=True) and kept[-1] < 4
    # each batch's time split: every prompt token prefilled, the steps in whole STOP_CHECK_EVERYs
    splits = re.findall(r"batch of \d rows x \d+ columns done: prefill [\d.]+ s \((\d+) prompt tokens.*decode [\d.]+ s "
                        r"\((\d+) steps, [\d.]+ ms a step, ([\d.]+) live rows.* (\d+)% of the key columns",
                        caplog.text)
    assert splits, caplog.text[-2000:]
    assert sum(int(tokens) for tokens, _, _, _ in splits) == sum(map(len, prompts.values()))
    assert all(int(steps) % generate.STOP_CHECK_EVERY == 0 and 0 < float(live) <= 4 for _, steps, live, _ in splits)
    assert all(0 < int(share) <= 100 for *_, share in splits)


@pytest.mark.parametrize("live_columns", [False, True])
def test_a_batch_counts_the_key_columns_its_attention_reads_and_those_of_live_contexts(live_columns, monkeypatch):
    """Under the span mask every row reads the batch's span (the longest row's, rounded up to
    SPAN_STEP); with LiveColumns a row at column c reads its c + 1 keys, which is what a live row
    needs. Rows of 5 and 40 prompt tokens and an empty one, then one released."""
    import dflash.nn.transformer as transformer
    from conftest import flash_varlen_stand_in
    from dflash.target.generate import ContinuousBatch
    from dflash.target.memory import BatchPlan
    from dflash.target.static import SPAN_STEP

    monkeypatch.setattr(transformer, "flash_varlen", flash_varlen_stand_in)
    target = tiny_target("llama", dtype=torch.float32)
    plan = BatchPlan(rows=3, prefill_tokens=64, prefill_rows=3, peak_bytes=0, report="")
    batch = ContinuousBatch(target, 3, 2 * SPAN_STEP, plan, max_new_tokens=8, stop_ids=set(), sampling=None,
                            compiled=False)
    batch.static.live_columns = live_columns
    batch.fill([0, 1], [0, 1], {0: [3, 4, 5, 6, 7], 1: list(range(2, 42))})
    batch.step()
    first = (6 + 41 + 1) if live_columns else 3 * SPAN_STEP
    assert (batch.columns_read, batch.columns_live) == (first, 6 + 41)
    batch.release([1])
    batch.step()
    assert (batch.columns_read, batch.columns_live) == (first + ((7 + 1 + 1) if live_columns else 3 * SPAN_STEP),
                                                        6 + 41 + 7)


def test_rows_at_their_own_columns_step_alike_when_each_reads_only_its_own_keys(monkeypatch):
    """A step of rows at their own columns gives the same choices and features whether every row
    reads the batch's span under a mask (on a CPU) or only its own keys (LiveColumns: FlashAttention
    on a GPU, its stand-in here)."""
    import dflash.nn.transformer as transformer
    from conftest import flash_varlen_stand_in

    monkeypatch.setattr(transformer, "flash_varlen", flash_varlen_stand_in)
    target = tiny_target("qwen3", dtype=torch.float64)
    vocab = target.model.config.vocab_size
    static = StaticTarget(target, 3, 300, cuda_graphs=False)
    assert not static.live_columns, "a CPU has no FlashAttention: the span mask"
    g = torch.Generator().manual_seed(5)
    lengths = [5, 270, 9]
    for row, n in enumerate(lengths):
        static.extend_rows(torch.randint(0, vocab, (1, n), generator=g), torch.tensor([row]), 0, torch.tensor([n - 1]))
    ids, columns = torch.randint(0, vocab, (3, 1), generator=g), torch.tensor(lengths)[:, None]
    span = static.attended_columns(max(lengths) + 1)
    masked = static._forward(ids, columns, span, features=True)
    live = static._forward(ids, columns, span, features=True, own_keys=True)
    assert torch.equal(live[0], masked[0])
    torch.testing.assert_close(live[1], masked[1], rtol=1e-10, atol=1e-10)


@pytest.mark.gpu
def test_on_a_gpu_rows_read_their_own_keys_through_flash_attention_as_the_span_mask_reads_them():
    """The device's PyTorch has FlashAttention's variable-length kernel with a key count per row, a
    bf16 StaticTarget takes it for rows at their own columns, and that step gives the span mask's
    features (bf16 rounding) and, replayed as a CUDA graph, its own eager choices."""
    target = tiny_target("qwen3", dtype=torch.bfloat16)
    target.model.cuda()
    vocab = target.model.config.vocab_size
    static = StaticTarget(target, 4, 512)
    assert static.live_columns, "FlashAttention with per-row key counts is missing from this PyTorch"
    g = torch.Generator().manual_seed(6)
    lengths = [5, 480, 40, 1]
    for row, n in enumerate(lengths):
        static.extend_rows(torch.randint(0, vocab, (1, n), generator=g).cuda(), torch.tensor([row]).cuda(), 0,
                           torch.tensor([n - 1]).cuda())
    ids = torch.randint(0, vocab, (4, 1), generator=g).cuda()
    columns = torch.tensor(lengths).cuda()
    span = static.attended_columns(max(lengths) + 1)
    live = static._forward(ids, columns[:, None], span, features=True, own_keys=True)
    masked = static._forward(ids, columns[:, None], span, features=True)
    torch.testing.assert_close(live[1].float(), masked[1].float(), rtol=3e-2, atol=3e-2)
    for _ in range(2):  # a capture, then a replay
        assert torch.equal(static.step_rows(ids, columns, max(lengths) + 1), live[0])


def test_with_compiled_prefill_only_fresh_prompts_run_the_layer_functions_compiled_for_every_shape(monkeypatch):
    """compiled_prefill: a prompt entering rows at column 0 (attending only over itself) runs
    dynamic_layer_parts; a chunk over cached columns and the decode steps keep their own. Eager
    stand-ins count the calls: the choices equal a StaticTarget's without the option."""
    import dflash.target.static as static_module
    from dflash.target.static import finish_layer, project_qkv

    calls = []

    def counted(function):
        def run(*args, **kwargs):
            calls.append(function.__name__)
            return function(*args, **kwargs)
        return run

    monkeypatch.setattr(static_module, "dynamic_layer_parts", lambda: (counted(project_qkv), counted(finish_layer)))
    target = tiny_target("qwen3")
    layers, g = len(target.layers), torch.Generator().manual_seed(2)
    ids = torch.randint(0, target.model.config.vocab_size, (3, 20), generator=g)
    every, last = torch.arange(3), torch.full((3,), 19)
    plain, compiled = StaticTarget(target, 3, 64), StaticTarget(target, 3, 64, compiled_prefill=True)
    want = plain.extend_rows(ids, every, 0, last)
    assert torch.equal(compiled.extend_rows(ids, every, 0, last), want)
    assert calls == ["project_qkv", "finish_layer"] * layers
    calls.clear()
    more = torch.randint(0, target.model.config.vocab_size, (3, 4), generator=g)  # a chunk over cached columns
    assert torch.equal(compiled.extend_rows(more, every, 20, torch.full((3,), 3)),
                       plain.extend_rows(more, every, 20, torch.full((3,), 3)))
    columns = torch.full((3,), 24)
    assert torch.equal(compiled.step_rows(want, columns, 25), plain.step_rows(want, columns, 25))
    assert calls == []


@pytest.mark.gpu
def test_on_a_gpu_a_prefill_compiled_for_every_shape_chooses_as_the_eager_one():
    """compiled_prefill on CUDA, prompts of three shapes: bf16 features within rounding of the
    eager prefill's."""
    target = tiny_target("qwen3", dtype=torch.bfloat16)
    target.model.cuda()
    vocab, g = target.model.config.vocab_size, torch.Generator().manual_seed(3)
    for rows, length in [(3, 21), (5, 40), (2, 77)]:
        ids = torch.randint(0, vocab, (rows, length), generator=g).cuda()
        every, last = torch.arange(rows).cuda(), torch.full((rows,), length - 1).cuda()
        eager = StaticTarget(target, rows, 128, cuda_graphs=False)
        compiled = StaticTarget(target, rows, 128, cuda_graphs=False, compiled_prefill=True)
        columns = torch.arange(length).cuda()[None].expand(rows, -1)
        want = eager._forward(ids, columns, None, rows=every, last=last, features=True)[1].float()
        got = compiled._forward(ids, columns, None, rows=every, last=last, features=True)[1].float()
        assert float((got - want).abs().max() / want.abs().max()) < 3e-2


def test_decode_attention_alternatives_compute_what_the_static_target_calls(monkeypatch):
    """dflash.benchmarks.decode_attention times other kernels against StaticTarget's SDPA call;
    they must give the same output (rows that see different numbers of columns). LiveColumns runs
    here on FlashAttention's stand-in."""
    import dflash.benchmarks.decode_attention as decode_attention
    import dflash.nn.transformer as transformer
    from conftest import flash_varlen_stand_in

    monkeypatch.setattr(transformer, "flash_varlen", flash_varlen_stand_in)
    monkeypatch.setattr(decode_attention, "live_columns_supported", lambda *a, **k: True)
    rows = decode_attention.compare([(5, 40), (3, 17)], kv_heads=2, group=3, head_dim=8, device=torch.device("cpu"),
                                    dtype=torch.float32, repeats=1)
    assert {r["implementation"] for r in rows} == {"sdpa (span mask)", "matmul + softmax", "flash varlen (LiveColumns)"}
    assert all(r["max_abs_diff"] < 1e-5 and r["ms"] > 0 for r in rows)



def test_the_regeneration_benchmark_times_a_step_and_the_whole_engine():
    from dflash.benchmarks.regen_step import parse_shapes, time_engine, time_steps

    target = tiny_target("llama", dtype=torch.float32)
    result = time_steps(target, 3, 40, 20, steps=2, profile=True)
    assert result["capacity"] == 48 and result["ms_per_step"] > 0 and result["row_steps_per_second"] > 0
    assert result["prefill_ms"] > 0 and result["prefill_tokens_per_second"] > 0
    # the 12 costliest ops of each part: which ones depends on the machine's load
    assert "aten::" in result["profile"] and "aten::" in result["prefill_profile"]
    assert parse_shapes("4x64x32,2x512x500") == [(4, 64, 32), (2, 512, 500)]
    with pytest.raises(SystemExit, match="prompt \\+ 8 <= capacity"):
        parse_shapes("4x64x60")
    engine = time_engine(target, {0: [5, 6, 7], 1: [8, 9]}, 6, set(), batch_tokens=0)
    assert engine["new_tokens"] == 12 and engine["stopped"] == 0 and engine["new_tokens_per_second"] > 0
