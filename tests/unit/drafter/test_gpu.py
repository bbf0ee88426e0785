"""GPU checks (run on a CUDA host: python -m pytest -m gpu). Flex attention with the block mask
must agree with SDPA on the dense mask, forward and backward; the whole fast training step
(flex, fused lm_head loss, compiled layers) with the naive one; the compiled target with the eager one."""

from __future__ import annotations

import pytest
import torch

from dflash.drafter.attention import BlockLayout, dense_block_mask, flex_block_mask
from dflash.nn.transformer import attend
from dflash.util.runtime import compile_dynamic

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("window", [0, 64], ids=["full", "window64"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_flex_matches_dense_sdpa(dtype, tol, window):
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"
    torch.manual_seed(0)
    b, s, n, bs, hq, hkv, d = 2, 300, 24, 16, 8, 2, 64
    anchors = torch.stack([torch.randperm(s - 2)[:n].sort().values for _ in range(b)]).cuda()
    valid = torch.ones(b, n, dtype=torch.bool, device="cuda")
    valid[1, -5:] = False  # padding blocks
    layout = BlockLayout(anchors, valid, s, bs, window=window)
    q = torch.randn(b, hq, n * bs, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, hkv, s + n * bs, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, hkv, s + n * bs, d, device="cuda", dtype=dtype, requires_grad=True)
    grad = torch.randn(b, hq, n * bs, d, device="cuda", dtype=dtype)

    def run(mask):
        for t in (q, k, v):
            t.grad = None
        out = attend(q, k, v, mask)
        out.backward(grad)
        return out.detach().float(), [t.grad.float() for t in (q, k, v)]

    dense_out, dense_grads = run(dense_block_mask(layout))
    flex_out, flex_grads = run(flex_block_mask(layout, n * bs))
    real = valid.repeat_interleave(bs, dim=1)[:, None, :, None]
    torch.testing.assert_close(flex_out * real, dense_out * real, rtol=tol, atol=tol)
    for a, b_ in zip(flex_grads, dense_grads):
        torch.testing.assert_close(a, b_, rtol=tol, atol=tol * 10)


def drafter_step_for(kernels: str, dtype: torch.dtype, kl_weight: float = 0.0):
    """A small drafter (same seed, same weights) wired with the fast or the naive kernels, as
    train.step_settings and the layer compile set them up."""
    from transformers import Qwen3Config

    from dflash.drafter.step import DrafterStep, StepSettings
    from dflash.drafter.model import DFlashDrafter, drafter_config
    from dflash.drafter.objective import slot_weights

    vocab, hidden = 1000, 256
    target_config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=512, num_hidden_layers=8,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    torch.manual_seed(0)
    with torch.device("cuda"):
        drafter = DFlashDrafter(drafter_config(target_config, 2, [1, 3, 5], 16, vocab - 1)).to(dtype)
        embed = torch.nn.Embedding(vocab, hidden, dtype=dtype).requires_grad_(False)
        head = torch.nn.Linear(hidden, vocab, bias=False, dtype=dtype).requires_grad_(False)
    fast = kernels == "fast"
    if fast:
        for layer in drafter.layers:
            compile_dynamic(layer)
    settings = StepSettings(max_anchors=48, slot_weights=slot_weights(16, 7.0),
                            attention_backend="flex" if fast else "sdpa", fused_loss=fast,
                            lm_head_chunk=100 if fast else 1 << 62, kl_weight=kl_weight)
    return DrafterStep(drafter, embed, head, settings)


@pytest.mark.parametrize("kl_weight", [0.0, 1.0])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_fast_training_step_matches_the_naive_one(dtype, tol, kl_weight):
    """Flex attention + fused lm_head loss (+ KL to the target's distribution) + compiled layers
    give the loss and every parameter gradient of dense-mask SDPA + full logits + eager layers,
    on a realistic block layout (sampled anchors, padding blocks, two rows of different
    response spans)."""

    b, s = 2, 400
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 999, (b, s), generator=generator).cuda()
    loss_mask = torch.zeros(b, s, dtype=torch.bool, device="cuda")
    loss_mask[0, 50:] = True
    loss_mask[1, 300:330] = True  # fewer candidates than anchors: padding blocks in row 1
    features = torch.randn(b, s, 3 * 256, generator=generator).cuda().to(dtype)
    final_hidden = torch.randn(b, s, 256, generator=generator).cuda().to(dtype)
    results = []
    for kernels in ("fast", "naive"):
        step = drafter_step_for(kernels, dtype, kl_weight)
        blocks = step.sample_blocks(ids, loss_mask, torch.Generator().manual_seed(1))
        out = step.loss(blocks, features, final_hidden)
        out.loss.backward()
        grads = {name: p.grad.float() for name, p in step.drafter.named_parameters()}
        results.append((out.loss.detach().float(), grads, out.slot_correct))
    (fast_loss, fast_grads, fast_correct), (naive_loss, naive_grads, naive_correct) = results
    torch.testing.assert_close(fast_loss, naive_loss, rtol=tol, atol=tol)
    assert fast_grads.keys() == naive_grads.keys()
    for name in fast_grads:
        scale = naive_grads[name].abs().max().clamp(min=1e-6)
        torch.testing.assert_close(fast_grads[name] / scale, naive_grads[name] / scale, rtol=tol, atol=tol,
                                   msg=lambda m, name=name: f"{name}: {m}")
    if dtype == torch.float32:
        assert torch.equal(fast_correct, naive_correct)


def test_fast_training_step_on_a_micro_batch_with_few_anchors():
    """One sequence with a 6-token reply has 5 anchors: 80 query rows, under the 128 at which
    compiled flex attention picks its decoding kernel, which has no backward (an InductorError
    "NoValidChoicesError" before the step padded such micro-batches). Loss and gradients must
    match the naive step's."""
    b, s = 1, 200
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 999, (b, s), generator=generator).cuda()
    loss_mask = torch.zeros(b, s, dtype=torch.bool, device="cuda")
    loss_mask[0, 190:196] = True
    features = torch.randn(b, s, 3 * 256, generator=generator).cuda()
    results = []
    for kernels in ("fast", "naive"):
        step = drafter_step_for(kernels, torch.float32)
        blocks = step.sample_blocks(ids, loss_mask, torch.Generator().manual_seed(1))
        out = step.loss(blocks, features)
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad for n, p in step.drafter.named_parameters()}))
    (fast_loss, fast_grads), (naive_loss, naive_grads) = results
    torch.testing.assert_close(fast_loss, naive_loss, rtol=1e-4, atol=1e-4)
    for name, grad in naive_grads.items():
        scale = grad.abs().max().clamp(min=1e-6)
        torch.testing.assert_close(fast_grads[name] / scale, grad / scale, rtol=1e-4, atol=1e-4)


def test_compiled_drafter_layers_train_micro_batches_of_every_size_on_the_variants_compiled_first():
    """Inductor fuses a norm's backward only above some sizes; under dynamic shapes each size test
    became a guard, and a micro-batch on its other side compiled the layers again, mid-run (38 s on
    an H200 at an epoch's end, where the small micro-batches are). Compiled as training compiles them
    (compile_dynamic), the layers train micro-batches of 2 to 32 rows (1,536 to 24,576 draft
    positions through the norms of 256 features: across every size test) on the variants the first
    micro-batch compiled (the first layer's input without gradient, the others' with)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from dflash.drafter.model import DFlashLayer

    torch._dynamo.reset()
    step = drafter_step_for("fast", torch.bfloat16)
    generator = torch.Generator().manual_seed(0)

    def train_on(rows: int) -> None:
        s = 400
        ids = torch.randint(0, 999, (rows, s), generator=generator).cuda()
        loss_mask = torch.zeros(rows, s, dtype=torch.bool, device="cuda")
        loss_mask[:, 50:] = True  # 350 candidates: every row drafts its 48 anchors x 16 positions
        features = torch.randn(rows, s, 3 * 256, generator=generator).cuda().to(torch.bfloat16)
        blocks = step.sample_blocks(ids, loss_mask, torch.Generator().manual_seed(rows))
        step.loss(blocks, features).loss.backward()

    def layer_variants() -> int:
        return len(_debug_get_cache_entry_list(DFlashLayer.forward))

    train_on(8)
    compiled_first = layer_variants()
    for rows in (2, 32, 3, 16):
        train_on(rows)
    assert layer_variants() == compiled_first


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_compiled_target_features_match_eager(dtype, tol):
    """The fast path compiles the target's MLPs and norms; features and a cached decode step
    must stay what the eager model gives."""
    from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

    from dflash.target.frozen import FrozenTarget

    config = Qwen3Config(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to("cuda", dtype)
    ids = torch.randint(0, 1000, (3, 77), device="cuda")
    eager = FrozenTarget(model, [1, 3, 4])
    want = eager.features(ids).features
    want_logits = eager.decode_step(ids[:, :5], DynamicCache()).logits
    eager.compile_pointwise()
    for length in (77, 50):  # two lengths: the dynamic compile must not be tied to the first
        got = eager.features(ids[:, :length]).features
        torch.testing.assert_close(got.float(), want[:, :length].float(), rtol=tol, atol=tol)
    got_logits = eager.decode_step(ids[:, :5], DynamicCache()).logits
    torch.testing.assert_close(got_logits.float(), want_logits.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fast_decoding_with_cuda_graphs_gives_the_plain_paths_tokens(arch, monkeypatch):
    """The static-cache path replays CUDA graphs only on a GPU: greedy and speculative decoding
    (through rejected drafts of every length) and batched generation must give HF's tokens."""
    import dflash.eval.speculative as speculative
    from conftest import tiny_drafter, tiny_target
    from dflash.target.generate import generate_batches
    from dflash.target.graphs import GraphReplays

    target = tiny_target(arch, dtype=torch.float32)
    target.model.cuda()
    prompts = [[5, 17, 3, 44, 9], [60, 2, 2, 2, 71, 30, 8, 1, 90, 12, 13]]
    plain = [speculative.greedy_decode(target, p, 40, set()).tokens for p in prompts]
    drafter = tiny_drafter(target, block_size=4).cuda().eval()
    decoder = speculative.Decoder(target, drafter, 64, "fast")
    assert decoder.draft.graphs.enabled
    for prompt, tokens in zip(prompts, plain):
        assert decoder.greedy(prompt, 40, set()).tokens == tokens
        assert decoder.speculative(prompt, 40, set()).tokens == tokens
    replies = {}
    captures = GraphReplays.captures
    for indices, rows in generate_batches(target, dict(enumerate(prompts)), 40, set(), batch_tokens=10_000):
        replies.update(zip(indices, rows))
    assert [replies[i] for i in range(len(prompts))] == [(tokens, "length") for tokens in plain]
    assert GraphReplays.captures > captures and GraphReplays.capture_seconds > 0  # what regeneration reports
    reference = torch.tensor(prompts[1] + plain[1] + [0] * 8, device="cuda")

    def oracle(session):  # right, then wrong at a random slot; on the device, as it is captured
        guess = reference[session._anchor + session._offsets[0, 1:]]
        spoiled = (torch.rand((), device="cuda") < 0.6) & (torch.arange(3, device="cuda")
                                                             == torch.randint(0, 3, (), device="cuda"))
        return torch.where(spoiled, (guess + 1) % 90, guess)

    monkeypatch.setattr(speculative.DraftSession, "_guess", oracle)
    torch.manual_seed(0)
    spec = speculative.Decoder(target, drafter, 64, "fast", compile_drafter=False).speculative(prompts[1], 40, set())
    assert spec.tokens == plain[1]
    assert min(spec.accepted) < 3 == max(spec.accepted), "the proposals follow the acceptance worked out on the device"


@pytest.mark.parametrize("window", [0, 6], ids=["full", "window6"])
def test_compiled_drafter_steps_write_and_propose_what_the_eager_ones_do(window):
    """On the fast path the drafter's two steps are compiled, then captured as CUDA graphs: the
    context they write, the acceptance they work out and the tokens they propose must be the
    eager steps' (float32), for verified blocks that accept none, some and all of the drafts."""
    from conftest import tiny_drafter, tiny_target
    from dflash.eval.speculative import DraftSession

    target = tiny_target("qwen3", dtype=torch.float32)
    target.model.cuda()
    drafter = tiny_drafter(target, block_size=4, window=window).cuda().eval()
    compiled = DraftSession(target, drafter, 64, graphed=True, compiled=True)
    eager = DraftSession(target, drafter, 64, graphed=False, compiled=False)
    assert hasattr(compiled._advance_step, "_torchdynamo_orig_callable"), "the graphed steps are not compiled"
    torch.manual_seed(0)
    features = torch.randn(1, 40, target.hidden_size * len(target.layer_ids), device="cuda")
    proposals = {}
    for name, session in (("compiled", compiled), ("eager", eager)):
        session.extend(features[:, :12], 0)  # a prompt's features: eager on both
        proposals[name] = [session.start(torch.tensor([7], device="cuda"), 12).tolist()]
        anchor = 12
        for accepted in (0, 2, 3, 1):  # verified blocks: the compiled, graphed step on one side
            proposal = session.proposal[0]
            choice = torch.cat([proposal[1:1 + accepted], (proposal[1 + accepted:] + 1) % 90,
                                torch.tensor([5 + accepted], device="cuda")])[None]
            session.advance(torch.cat([proposal[1:], choice[0]]), features[:, anchor:anchor + 4], anchor)
            anchor += accepted + 1
            proposals[name].append(session.proposal.tolist())
            assert int(session._anchor) == anchor and proposals[name][-1][0][0] == int(choice[0, accepted])
    torch.testing.assert_close(compiled.cache.keys, eager.cache.keys, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(compiled.cache.values, eager.cache.values, rtol=1e-4, atol=1e-5)
    assert compiled.cache.keys[:, :, :, 12:26].abs().sum() > 0
    assert proposals["compiled"] == proposals["eager"]


@pytest.mark.parametrize("top_p", [1.0, 0.99], ids=["gumbel", "nucleus-by-rejection"])
def test_sampling_inside_cuda_graphs_draws_fresh_numbers_at_every_replay(top_p):
    """Regeneration with --sampling target (and Magpie) draws inside the captured step: every row
    and every replay must get new random numbers, and the seed must repeat the run."""
    from conftest import tiny_target
    from dflash.target.generate import generate_batches
    from dflash.target.sampling import Sampling

    target = tiny_target("llama", dtype=torch.float32)
    target.model.cuda()
    prompts = {i: [5, 17, 3] for i in range(64)}

    def draw(seed):
        torch.manual_seed(seed)
        replies = {}
        for indices, rows in generate_batches(target, prompts, 12, set(), batch_tokens=64 * 512,
                                             sampling=Sampling(top_p=top_p)):
            replies.update((i, tokens) for i, (tokens, _) in zip(indices, rows))
        return [replies[i] for i in range(64)]

    first = draw(0)
    assert draw(0) == first and draw(1) != first
    columns = list(zip(*first))[1:]  # the tokens of each graph replay, one per row
    assert all(len(set(column)) > 1 for column in columns), "rows draw independently inside the graph"
    assert len(set(columns)) == len(columns), "each replay draws new numbers"


def test_the_decode_profile_sees_the_kernels_inside_each_parts_cuda_graph():
    """On a GPU the cycle's parts replay CUDA graphs; their profile must count the kernels inside
    (a graph launch alone would report none), and the decoder stays exact afterwards."""
    import dflash.eval.speculative as speculative
    from conftest import tiny_drafter, tiny_target
    from dflash.benchmarks.decode import cycle_part_calls, kernel_profile

    target = tiny_target("llama", dtype=torch.float32)
    target.model.cuda()
    decoder = speculative.Decoder(target, tiny_drafter(target, block_size=4).cuda().eval(), 64, "fast")
    profiles = kernel_profile(cycle_part_calls(decoder, [5, 17, 3, 44, 9]), target.device, repeats=3)
    for name, summary in profiles.items():
        assert summary["kernels_per_call"] >= 5 and summary["kernel_ms_per_call"] > 0, (name, summary)
    assert decoder.speculative([5, 17, 3, 44, 9], 12, set()).tokens \
        == speculative.greedy_decode(target, [5, 17, 3, 44, 9], 12, set()).tokens
