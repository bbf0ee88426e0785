"""Speculative decoding is lossless: its output equals plain greedy decoding, on HF's forward
(plain) and on the static-cache decoder (fast), and the fast path gives the plain path's tokens."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

import dflash.eval.speculative as speculative
from conftest import MASK_ID, tiny_drafter, tiny_target
from dflash.target.static import StaticTarget

PROMPTS = [[5, 17, 3, 44, 9], [60, 2, 2, 2, 71, 30, 8, 1, 90, 12, 13]]
NEW_TOKENS = 40


@pytest.mark.parametrize("kind", ["plain", "fast"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_real_drafter_output_equals_greedy(arch, prompt, kind):
    target = tiny_target(arch)
    drafter = tiny_drafter(target, block_size=4)
    greedy = speculative.greedy_decode(target, prompt, NEW_TOKENS, eos_ids=set())
    spec = speculative.speculative_decode(target, drafter, prompt, NEW_TOKENS, eos_ids=set(), kind=kind)
    assert len(greedy.tokens) == NEW_TOKENS
    assert spec.tokens == greedy.tokens
    assert all(0 <= k <= 3 for k in spec.accepted)


def test_fast_path_gives_the_plain_paths_tokens_and_features(arch):
    """Same greedy tokens, and the same target features at every decoded position."""
    target = tiny_target(arch)
    prompt = PROMPTS[1]
    plain = speculative.greedy_decode(target, prompt, NEW_TOKENS, eos_ids=set())
    fast = speculative.greedy_decode(target, prompt, NEW_TOKENS, eos_ids=set(), kind="fast")
    assert fast.tokens == plain.tokens
    session = StaticTarget(target, batch=1, capacity=64)
    ids = torch.tensor([prompt + plain.tokens])
    session.prefill(ids[:, :5])
    _, features = session.step(ids[:, 5:], 5)  # over the cache, as decoding does
    torch.testing.assert_close(features, target.features(ids).features[:, 5:])


@pytest.mark.parametrize("kind", ["plain", "fast"])
def test_every_acceptance_length_stays_lossless(arch, kind, monkeypatch):
    """An oracle drafter that knows the greedy answer but errs at random slots drives the
    verifier through every acceptance length 0..B-1: caches must be cropped and extended right."""
    target = tiny_target(arch)
    block = 6
    drafter = tiny_drafter(target, block_size=block)
    prompt = PROMPTS[1]
    reference = prompt + speculative.greedy_decode(target, prompt, NEW_TOKENS + 2 * block, eos_ids=set()).tokens
    rng = random.Random(0)

    def oracle(session):
        anchor = int(session._anchor)
        assert int(session._block_ids[0, 0]) == reference[anchor], "the device's acceptance must be the host's"
        guess = list(reference[anchor + 1: anchor + block])
        if rng.random() < 0.6:
            guess[rng.randrange(block - 1)] = MASK_ID - 1
        return torch.tensor(guess)

    monkeypatch.setattr(speculative.DraftSession, "_guess", oracle)
    spec = speculative.speculative_decode(target, drafter, prompt, NEW_TOKENS, eos_ids=set(), kind=kind)
    assert spec.tokens == reference[len(prompt):len(prompt) + NEW_TOKENS]
    assert max(spec.accepted) == block - 1 and min(spec.accepted) < block - 1
    assert spec.target_forwards < NEW_TOKENS / 2


def reference_greedy(target, prompt: list[int], count: int) -> list[int]:
    """Greedy decoding the plainest way: HF's forward over the whole sequence, no cache."""
    ids = list(prompt)
    for _ in range(count):
        ids.append(int(target.model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@contextlib.contextmanager
def host_reads():
    """Counts the reads of a tensor's values into Python (on a GPU, each waits for the device)."""
    reads = []
    with pytest.MonkeyPatch.context() as patch:
        for name in ("tolist", "item", "__int__", "__bool__", "__float__", "__index__"):
            def counted(self, *args, _name=name, _original=getattr(torch.Tensor, name), **kwargs):
                reads.append(_name)
                return _original(self, *args, **kwargs)

            patch.setattr(torch.Tensor, name, counted)
        yield reads


@pytest.mark.parametrize("kind", ["plain", "fast"])
def test_greedy_reads_back_every_few_steps_and_gives_the_reply_up_to_its_first_end(kind, monkeypatch):
    """Decoder.greedy keeps its tokens on the device and looks for an end of sequence every
    EOS_CHECK_EVERY steps: the reply is the greedy one cut after its first end, whether that is
    the first token, the last or the first of a checked window, later, or never, and whatever
    max_new_tokens is (a multiple of the window or not)."""
    monkeypatch.setattr(speculative, "EOS_CHECK_EVERY", 4)
    target = tiny_target("llama")
    prompt = PROMPTS[0]
    free = reference_greedy(target, prompt, 30)
    decoder = speculative.Decoder(target, None, len(prompt) + 30, kind)
    first = {token: free.index(token) for token in reversed(free)}
    ends = {0, 6, 7, 17, 20, 25, 26}  # 7 and 20: the last and the first token of a window
    assert ends <= set(first.values()), "the reply's first occurrences moved: pick other ends"
    for new_tokens in (1, 4, 9, 30):
        assert decoder.greedy(prompt, new_tokens, set()).tokens == free[:new_tokens]
    for new_tokens, end in [(30, end) for end in sorted(ends)] + [(9, 7), (9, 20)]:
        eos = {free[end], MASK_ID}  # MASK_ID: never emitted here
        assert decoder.greedy(prompt, new_tokens, eos).tokens == free[: min(end + 1, new_tokens)]


def test_greedy_reads_the_device_once_per_check_not_per_token(monkeypatch):
    monkeypatch.setattr(speculative, "EOS_CHECK_EVERY", 4)
    target = tiny_target("llama")
    decoder = speculative.Decoder(target, None, 64, "fast")
    with host_reads() as reads:
        reply = decoder.greedy(PROMPTS[0], 30, {MASK_ID})
    assert len(reply.tokens) == 30
    assert len(reads) <= 30 // 4 + 1, reads  # one per check, one for the reply


def test_each_replayed_step_writes_the_same_when_run_again(monkeypatch):
    """A CUDA graph's capture runs its step three times (two warm-ups, then the capture), so
    every step the decoder replays must write the same each time it runs. Here the target's and
    the drafter's steps each run twice, through every acceptance length: the device must still
    work out the host's acceptance (anchor and bonus token) and the output stay greedy's."""
    from dflash.target.graphs import GraphReplays

    target = tiny_target("qwen3")
    block, prompt = 6, PROMPTS[1]
    reference = prompt + speculative.greedy_decode(target, prompt, NEW_TOKENS + 2 * block, eos_ids=set()).tokens

    def oracle(session):  # right, but wrong at a slot that depends on the anchor alone
        anchor = int(session._anchor)
        assert int(session._block_ids[0, 0]) == reference[anchor], "the device's acceptance must be the host's"
        guess = list(reference[anchor + 1: anchor + block])
        if anchor % 3:
            guess[anchor % (block - 1)] = MASK_ID - 1
        return torch.tensor(guess)

    def twice(self, key, step):
        step()
        return step()

    monkeypatch.setattr(speculative.DraftSession, "_guess", oracle)
    monkeypatch.setattr(GraphReplays, "__call__", twice)
    decoder = speculative.Decoder(target, tiny_drafter(target, block_size=block), 64, "fast")
    decoder.session.graphs.enabled = True  # the target's steps too go through GraphReplays
    spec = decoder.speculative(prompt, NEW_TOKENS, set())
    assert spec.tokens == reference[len(prompt):len(prompt) + NEW_TOKENS]
    assert len(set(spec.accepted)) > 2
    assert decoder.greedy(prompt, NEW_TOKENS, set()).tokens == spec.tokens


def test_every_draft_accepted_up_to_the_capacity_stays_inside_the_drafters_cache(monkeypatch):
    """The next block is proposed on the device before the host reads that decoding has ended: after
    the last verify, with every draft accepted, it reaches B - 3 columns past the decoder's
    capacity (here 64 = 11 prompt + 47 new + B, B = 6)."""
    target = tiny_target("llama")
    block, new_tokens, prompt = 6, 47, PROMPTS[1]
    reference = prompt + speculative.greedy_decode(target, prompt, new_tokens + 2 * block, eos_ids=set()).tokens
    anchors = []

    def oracle(session):  # always right
        anchors.append(int(session._anchor))
        return torch.tensor(reference[anchors[-1] + 1: anchors[-1] + block])

    monkeypatch.setattr(speculative.DraftSession, "_guess", oracle)
    decoder = speculative.Decoder(target, tiny_drafter(target, block_size=block), len(prompt) + new_tokens + block,
                                  "fast")
    spec = decoder.speculative(prompt, new_tokens, set())
    assert spec.tokens == reference[len(prompt):len(prompt) + new_tokens]
    assert set(spec.accepted[:-1]) == {block - 1}  # the last cycle counts only the tokens kept
    assert max(anchors) + block > decoder.capacity


def test_stops_at_eos():
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    greedy = speculative.greedy_decode(target, PROMPTS[0], NEW_TOKENS, eos_ids=set())
    eos = greedy.tokens[7]
    expected = greedy.tokens[: greedy.tokens.index(eos) + 1]
    assert speculative.greedy_decode(target, PROMPTS[0], NEW_TOKENS, {eos}).tokens == expected
    assert speculative.speculative_decode(target, drafter, PROMPTS[0], NEW_TOKENS, {eos}).tokens == expected
    assert speculative.greedy_decode(target, PROMPTS[0], NEW_TOKENS, {eos}, kind="fast").tokens == expected


@pytest.mark.parametrize("stop", ["eos", "max_new_tokens"])
def test_tokens_past_the_end_are_not_counted_as_accepted(monkeypatch, stop):
    """An oracle drafter whose blocks run on past the reply's end (an early end-of-sequence token,
    or max_new_tokens): the last cycle counts only the tokens the reply keeps, so tau (tokens per
    verify forward) is the reply's tokens over the forwards that made them."""
    target = tiny_target("qwen3")
    block = 8
    drafter = tiny_drafter(target, block_size=block)
    prompt = PROMPTS[0]
    reply = speculative.greedy_decode(target, prompt, NEW_TOKENS + block, eos_ids=set()).tokens
    end = next(i for i in range(2, block - 1) if reply[i] not in reply[:i])  # the reply's last token
    reference = prompt + reply + [0] * block  # the block proposed after the last verify reads on

    def oracle(session):
        anchor = int(session._anchor)
        return torch.tensor(reference[anchor + 1: anchor + block])

    monkeypatch.setattr(speculative.DraftSession, "_guess", oracle)
    eos, limit = ({reply[end]}, NEW_TOKENS) if stop == "eos" else (set(), end + 1)
    spec = speculative.speculative_decode(target, drafter, prompt, limit, eos_ids=eos)
    assert spec.tokens == reply[:end + 1]
    assert spec.accepted == [end - 1], "one cycle drafted B-1 right; the reply keeps end - 1 of them and its end"
    assert sum(k + 1 for k in spec.accepted) == len(spec.tokens) - 1  # the prefill made the first token


def test_demo_target_output_equals_greedy():
    """The shipped demo target with its tokenizer and held-out prompts."""
    from dflash.data.chat_formats import load_chat_jsonl
    from dflash.data.tokenization import load_tokenizer, prompt_ids
    from dflash.demo import DEMO_HELDOUT_DATA, DEMO_TARGET_DIR
    from dflash.drafter.model import DFlashDrafter, drafter_config
    from dflash.target.frozen import (FrozenTarget, default_target_layer_ids, load_target_config,
                                      resolve_mask_token_id)

    tokenizer = load_tokenizer(DEMO_TARGET_DIR)
    layers = default_target_layer_ids(load_target_config(str(DEMO_TARGET_DIR)).num_hidden_layers, 4)
    target = FrozenTarget.load(str(DEMO_TARGET_DIR), layers, torch.float32, torch.device("cpu"))
    mask_id = resolve_mask_token_id(tokenizer, target.model.config, None)
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config(target.model.config, 1, layers, 8, mask_id))
    eos = {tokenizer.eos_token_id}
    for messages in load_chat_jsonl(DEMO_HELDOUT_DATA)[:2]:
        prompt = prompt_ids(tokenizer, messages)
        greedy = speculative.greedy_decode(target, prompt, 48, eos)
        assert len(greedy.tokens) > 8
        assert speculative.speculative_decode(target, drafter, prompt, 48, eos).tokens == greedy.tokens
        assert speculative.speculative_decode(target, drafter, prompt, 48, eos, kind="fast").tokens == greedy.tokens


def test_the_decode_benchmark_times_and_profiles_each_part_of_a_cycle_and_leaves_the_decoder_exact():
    """dflash.benchmarks.decode replays the cycle's parts alone on a live decoder: each gets a
    time and a profile, and the decoder goes on giving greedy's tokens afterwards."""
    from dflash.benchmarks.decode import cycle_part_calls, cycle_parts, kernel_profile

    target = tiny_target("llama", dtype=torch.float32)
    decoder = speculative.Decoder(target, tiny_drafter(target, block_size=4).eval(), 64, "fast")
    prompt = [5, 17, 3, 44, 9]
    calls = cycle_part_calls(decoder, prompt)
    parts = cycle_parts(calls, target.device, repeats=3)
    assert set(parts) == {"propose_ms", "verify_ms", "advance_ms", "greedy_step_ms"}
    assert min(parts.values()) > 0
    profiles = kernel_profile(calls, target.device, repeats=2, top=3)
    assert set(profiles) == {"propose", "verify", "advance", "greedy_step"}
    for summary in profiles.values():  # on the CPU: the top-level ATen ops, linear layers among them
        assert summary["kernels_per_call"] > 5 and summary["kernel_ms_per_call"] > 0
        assert len(summary["costliest_ms_per_call"]) == 3
    # a verify of 4 tokens runs the target's layers, as a greedy step does; a proposal runs the drafter's
    assert any("linear" in name or "addmm" in name or "mm" in name for name in profiles["verify"]["costliest_ms_per_call"])
    expected = speculative.greedy_decode(target, prompt, 12, set()).tokens
    assert decoder.speculative(prompt, 12, set()).tokens == expected


def test_a_profile_counts_kernels_per_call_and_ranks_them_by_time():
    from dflash.benchmarks.decode import summarize_work

    work = [("gemv", 5.0), ("norm", 2.0), ("gemv", 5.0), ("norm", 2.0), ("copy", 1.0)] * 4  # 4 calls
    summary = summarize_work(work, calls=4, top=2)
    assert summary["kernels_per_call"] == 5
    assert summary["kernel_ms_per_call"] == 0.015
    assert summary["costliest_ms_per_call"] == {"gemv": 0.01, "norm": 0.004}
    assert summary["every_kernel"] == [["gemv", 2, 0.01], ["norm", 2, 0.004], ["copy", 1, 0.001]]


def test_the_decode_benchmark_divides_every_ratio_by_the_greedy_loops_step(tiny_setup, tmp_path, monkeypatch):
    """One greedy step for every ratio, named in the report: the fast greedy loop's time after
    the prefill, per token (not a step replayed alone, nor a loop timed with its prefills)."""
    import json

    import dflash.benchmarks.decode as decode
    from dflash.benchmarks.decode import main
    from dflash.drafter.model import head_vocab_size

    heads = []

    def drafter_recording_its_head(config):
        heads.append(head_vocab_size(config))
        return speculative.DFlashDrafter(config)

    monkeypatch.setattr(decode, "DFlashDrafter", drafter_recording_its_head)

    out = tmp_path / "decode.json"
    assert main(["--target", str(tiny_setup["target"]), "--prompts", str(tiny_setup["heldout"]), "--device", "cpu",
                 "--dtype", "float32", "--num-prompts", "2", "--plain-prompts", "1", "--max-new-tokens", "8",
                 "--block-size", "4", "--draft-layers", "1", "--draft-vocab", "64", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["draft_vocab"] == 64 and heads == [64], "the drafter decoded with a 64-row head"
    greedy, spec = report["fast_greedy"], report["fast_speculative"]
    assert report["greedy_step"].startswith("fast_greedy.ms_per_token")
    assert report["greedy_step_ms"] == greedy["ms_per_token"]
    assert report["cycle_in_greedy_steps"] == round(spec["ms_per_cycle"] / greedy["ms_per_token"], 2)
    tokens_after_the_first = greedy["tokens"] - greedy["prompts"]
    per_token = (greedy["seconds"] * 1000 - greedy["prefill_ms"] * greedy["prompts"]) / tokens_after_the_first
    # the report rounds seconds to 1 ms and each time in ms to 1 us: the recomputation is that exact
    rounding = (0.5 + 0.0005 * greedy["prompts"]) / tokens_after_the_first + 0.0005
    assert greedy["ms_per_token"] == pytest.approx(per_token, rel=0, abs=rounding)


def test_target_confidence_scores_every_greedy_reply_token():
    """dflash.benchmarks.target_confidence: one entry per reply token, and the shares grow with
    the threshold."""
    from dflash.benchmarks.target_confidence import confidence

    target = tiny_target("llama", dtype=torch.float32)
    prompts = [[5, 17, 3, 44, 9], [60, 2, 71]]
    replies = [speculative.greedy_decode(target, p, 10, {7}).tokens for p in prompts]
    report = confidence(target, prompts, 10, {7})
    assert report["positions"] == sum(map(len, replies))
    shares = list(report["share_below"].values())
    assert shares == sorted(shares) and 0 <= shares[0] and shares[-1] <= 1
    assert 0 < report["mean_chosen_probability"] <= 1
