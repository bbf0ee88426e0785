"""tau from one teacher-forced forward (the chain decoding walks over every anchor's streak)
equals the tau of real speculative decoding."""

from __future__ import annotations

import functools
import json
import operator
from dataclasses import asdict

import pytest
import torch

from dflash.eval.evaluate import EvalTally, chain_walk, continuation, evaluate, evaluate_tally
from dflash.eval.speculative import Decoder


def fit(step, input_ids, loss_mask, features, steps: int = 60) -> None:
    """Train the step's drafter on these sequences (AdamW, fixed seed)."""
    optimizer = torch.optim.AdamW(step.drafter.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        step.loss(step.sample_blocks(input_ids, loss_mask, generator), features).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_chain_walk_follows_decoding():
    # anchored at 0: 2 accepted, the target adds one token -> next anchor 3: 0 accepted -> 4: 5 -> 10
    streaks = [2, 9, 9, 0, 5, 9, 9, 9, 9, 9, 1, 1]
    assert chain_walk(streaks, produced=11) == [2, 0, 5]  # 11 reply tokens exist after that cycle
    # the reply ends (end of sequence, or max_new_tokens) inside a cycle: its tokens past the end do
    # not count, the bonus first (at 4: drafts 5..9 kept, 10 not), then the drafts (at 10: only 11)
    assert chain_walk(streaks, produced=10) == [2, 0, 4]
    assert chain_walk(streaks, produced=12) == [2, 0, 5, 0]
    assert chain_walk([9] * 20, produced=4) == [2]  # an early end: the first cycle keeps 3 tokens
    assert chain_walk([0, 0, 0], produced=3) == [0, 0]
    assert chain_walk([4], produced=1) == []  # the prompt's forward made the only token


@pytest.fixture(scope="module")
def fitted():
    """The demo target, four held-out prompts, and a drafter fitted to their own greedy
    continuations, so that cycles accept several drafts whatever the demo target is like (its
    held-out answers are hard)."""
    from dflash.data.chat_formats import load_chat_jsonl
    from dflash.data.tokenization import load_tokenizer, prompt_ids
    from dflash.demo import DEMO_HELDOUT_DATA, DEMO_TARGET_DIR
    from dflash.drafter.step import DrafterStep, StepSettings
    from dflash.drafter.model import DFlashDrafter, drafter_config
    from dflash.drafter.objective import slot_weights
    from dflash.target.frozen import (FrozenTarget, default_target_layer_ids, load_target_config,
                                      resolve_mask_token_id)

    tokenizer = load_tokenizer(DEMO_TARGET_DIR)
    layers = default_target_layer_ids(load_target_config(str(DEMO_TARGET_DIR)).num_hidden_layers, 3)
    target = FrozenTarget.load(str(DEMO_TARGET_DIR), layers, torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config(target.model.config, 2, layers, 8,
                                           resolve_mask_token_id(tokenizer, target.model.config, None)))
    step = DrafterStep(drafter, target.embed_tokens, target.lm_head,
                       StepSettings(max_anchors=32, slot_weights=slot_weights(8, 4.0), attention_backend="sdpa"))
    prompts = [prompt_ids(tokenizer, m) for m in load_chat_jsonl(DEMO_HELDOUT_DATA)[:4]]
    decoder = Decoder(target, None, 512)
    rows = [p + continuation(decoder, p, 48, set(), block_size=8)[0] for p in prompts]
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (prompt, row) in enumerate(zip(prompts, rows)):
        input_ids[i, : len(row)] = torch.tensor(row)
        loss_mask[i, len(prompt): len(row)] = True
    fit(step, input_ids, loss_mask, target.features(input_ids).features)
    return target, drafter.eval(), prompts, {tokenizer.eos_token_id}


def test_teacher_forced_tau_equals_real_tau_on_the_demo_target(fitted):
    target, drafter, prompts, eos = fitted
    report = evaluate(target, drafter, prompts, 48, eos)
    assert report.tau > 1.5 and report.acceptance[1] > 0, "cycles must accept several drafts for this to mean something"
    assert report.teacher_forced_tau == pytest.approx(report.tau, rel=0.02)
    assert abs(1 + report.teacher_forced_streak - report.tau) > abs(report.teacher_forced_tau - report.tau)


def test_the_tallies_of_prompts_judged_apart_add_up_to_the_figures_of_judging_them_together(fitted):
    """The final evaluation spread over ranks: each judges every k-th prompt and rank 0 adds the
    tallies (after a trip through JSON, as the store carries them). Every figure but the seconds is
    then the one a single rank gives."""
    target, drafter, prompts, eos = fitted
    whole = evaluate(target, drafter, prompts, 48, eos)
    shares = [evaluate_tally(target, drafter, prompts[i::3], 48, eos) for i in range(3)]
    carried = [EvalTally.from_dict(json.loads(json.dumps(asdict(t)))) for t in shares]
    assert carried == shares
    merged = functools.reduce(operator.add, carried).report()
    assert shares[0].report().tokens < whole.tokens and shares[0].report().tau != whole.tau  # the shares differ
    for name in ("prompts", "tokens", "diverged", "tau", "acceptance", "teacher_forced_acc", "teacher_forced_streak",
                 "teacher_forced_eal", "teacher_forced_tau"):
        assert getattr(merged, name) == pytest.approx(getattr(whole, name), rel=1e-12, abs=1e-15), name


def test_prompt_only_held_out_files_give_the_same_prompts(tmp_path):
    """--eval-data, `python -m dflash.eval --prompts` and the periodic eval take conversations
    that end in a user turn: only the prompt is used, so dropping the replies changes nothing."""
    import json

    from dflash.config import EVAL_FLAGS, check_eval_flags, parse_config
    from dflash.data.chat_formats import load_chat_jsonl
    from dflash.data.tokenization import load_tokenizer
    from dflash.demo import DEMO_HELDOUT_DATA, DEMO_TARGET_DIR
    from dflash.eval.evaluate import load_prompts

    prompt_only = tmp_path / "heldout.jsonl"
    conversations = load_chat_jsonl(DEMO_HELDOUT_DATA)[:8]
    prompt_only.write_text("".join(json.dumps({"messages": m[:-1]}) + "\n" for m in conversations))
    tokenizer = load_tokenizer(DEMO_TARGET_DIR)
    assert load_prompts(str(prompt_only), tokenizer, 8) == load_prompts(str(DEMO_HELDOUT_DATA), tokenizer, 8)
    config = parse_config(["--target", str(DEMO_TARGET_DIR), "--train-data", str(DEMO_HELDOUT_DATA),
                           "--eval-data", str(prompt_only), "--output-dir", str(tmp_path / "run")])
    assert config.data.eval_data == str(prompt_only)
    check_eval_flags(str(prompt_only), 8, 16, "float32", EVAL_FLAGS, min_prompts=1)


def test_a_drafter_that_memorised_its_samples_is_told_apart(tmp_path):
    """train_tau (the chain walk over training samples) against the held-out tau: a drafter fitted
    to 8 training samples scores far higher on them than on held-out prompts."""
    from dflash.data.dataset import TokenDataset
    from dflash.data.tokenization import load_tokenizer
    from dflash.data.prepare import prepare_dataset
    from dflash.demo import DEMO_HELDOUT_DATA, DEMO_TARGET_DIR, DEMO_TRAIN_DATA
    from dflash.drafter.step import DrafterStep, StepSettings
    from dflash.drafter.model import DFlashDrafter, drafter_config
    from dflash.drafter.objective import slot_weights
    from dflash.eval.periodic import TauProbe, memorising, probe_sequences
    from dflash.target.frozen import (FrozenTarget, default_target_layer_ids, load_target_config,
                                      resolve_mask_token_id)

    tokenizer = load_tokenizer(DEMO_TARGET_DIR)
    layers = default_target_layer_ids(load_target_config(str(DEMO_TARGET_DIR)).num_hidden_layers, 3)
    target = FrozenTarget.load(str(DEMO_TARGET_DIR), layers, torch.float32, torch.device("cpu"))
    dataset = TokenDataset(prepare_dataset(DEMO_TRAIN_DATA, tokenizer, tmp_path / "shard", 256))
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config(target.model.config, 2, layers, 8,
                                           resolve_mask_token_id(tokenizer, target.model.config, None)))
    step = DrafterStep(drafter, target.embed_tokens, target.lm_head,
                       StepSettings(max_anchors=32, slot_weights=slot_weights(8, 4.0), attention_backend="sdpa"))
    samples = [dataset[i] for i in range(8)]
    width = max(len(ids) for ids, _ in samples)
    input_ids = torch.full((8, width), tokenizer.pad_token_id)
    loss_mask = torch.zeros((8, width), dtype=torch.bool)
    for row, (ids, mask) in enumerate(samples):
        input_ids[row, :len(ids)], loss_mask[row, :len(ids)] = torch.from_numpy(ids), torch.from_numpy(mask)
    fit(step, input_ids, loss_mask, target.features(input_ids).features)
    probe = TauProbe(probe_sequences(target, tokenizer, str(DEMO_HELDOUT_DATA), 8, 48, 8, dataset),
                     target.embed_tokens, target.lm_head)
    prompt_lengths = [int(mask.argmax()) for _, mask in samples]
    assert [(len(p), len(r)) for p, r, _ in probe.train_sequences] == [
        (first, min(int(mask[first:].cumprod().sum()), 48))  # the trained reply, cut as held out
        for (_, mask), first in zip(samples, prompt_lengths)]
    result = probe.measure(drafter)
    assert memorising(result["train_tau"], result["tau"]), result


def test_drafters_judged_together_share_the_targets_continuations(monkeypatch):
    """Each drafter's teacher-forced measures come from the target's greedy continuations; two
    drafters on one target and prompts must decode them once, and get what they get alone."""
    from conftest import tiny_drafter, tiny_target

    import dflash.eval.evaluate as evaluate_module

    target = tiny_target(dtype=torch.float32)
    drafters = [tiny_drafter(target, block_size=4, seed=seed).eval() for seed in (1, 2)]
    prompts = [[5, 9, 13, 7, 21, 3], [11, 4, 8, 30, 2, 6, 17]]
    alone = [evaluate(target, d, prompts, 12, set()) for d in drafters]
    calls = []
    real = evaluate_module.continuation
    monkeypatch.setattr(evaluate_module, "continuation", lambda *a, **k: calls.append(1) or real(*a, **k))
    shared: dict = {}
    together = [evaluate(target, d, prompts, 12, set(), continuations=shared) for d in drafters]
    assert len(calls) == len(prompts), "the second drafter decoded the continuations again"
    assert list(shared) == [(4, 12)]
    for a, t in zip(alone, together):
        assert (t.teacher_forced_tau, t.teacher_forced_acc, t.tau) == (a.teacher_forced_tau, a.teacher_forced_acc, a.tau)
    decoder = Decoder(target, None, 64, "auto")
    assert shared[4, 12] == [(p, *real(decoder, p, 12, set(), 4)) for p in prompts]


def test_a_continuation_stops_b_minus_1_tokens_past_the_replys_end(monkeypatch):
    """The teacher-forced measures need the reply and the B-1 tokens the last cycle checks past it,
    no more: the target's tokens are those of one long greedy decode (float32), and the decoder
    makes only reply + B - 1 of them, not max_new_tokens + B - 1."""
    from conftest import tiny_target

    target = tiny_target(dtype=torch.float32)
    decoder = Decoder(target, None, 128, "auto")
    prompt, block = [5, 9, 13, 7, 21, 3], 4
    long = decoder.greedy(prompt, 40, eos_ids=set()).tokens
    end = next(i + 1 for i in range(6, 30) if long[i] not in long[:i])  # a token first made at i
    eos = long[end - 1]  # the reply ends there
    made = []
    real_greedy = decoder.greedy

    def counting_greedy(prompt, max_new_tokens, eos_ids):
        result = real_greedy(prompt, max_new_tokens, eos_ids)
        made.append(len(result.tokens))
        return result

    monkeypatch.setattr(decoder, "greedy", counting_greedy)
    tokens, kept = continuation(decoder, prompt, 32, {eos}, block)
    assert kept == end and tokens == long[:end + block - 1]
    assert sum(made) == end + block - 1, made
    tokens, kept = continuation(decoder, prompt, 32, set(), block)  # no end: max_new_tokens, then B-1
    assert kept == 32 and tokens == long[:32 + block - 1]


def test_train_tau_walks_the_first_reply_only_not_the_next_one_past_a_user_turn():
    """A sample with two replies in the loss (--loss-turns all): the training continuation that
    train_tau walks is the first reply, cut where its loss mask ends, as training's blocks are."""
    import numpy as np

    from dflash.eval.periodic import training_sequences

    ids = np.arange(20, dtype=np.int32)
    mask = np.zeros(20, dtype=bool)
    mask[4:9] = True  # the first reply
    mask[12:18] = True  # the second, after a user turn at 9..11
    assert training_sequences([(ids, mask)], 1, 48) == [(list(range(4)), list(range(4, 9)), 5)]
    assert training_sequences([(ids, mask)], 1, 3) == [(list(range(4)), [4, 5, 6], 3)]


def test_a_decoder_kept_for_a_longer_length_judges_a_shorter_one_as_its_own_decoder_would(fitted):
    """Judging at several lengths reuses the decoder made for the longest: a shorter length then
    decodes in caches larger than it needs, and must get the figures a decoder of its own gives."""
    target, drafter, prompts, eos = fitted
    alone = evaluate(target, drafter, prompts, 24, eos)
    decoders, continuations = {}, {}
    longer = evaluate(target, drafter, prompts, 48, eos, continuations=continuations, decoders=decoders)
    kept = list(decoders.values())
    shorter = evaluate(target, drafter, prompts, 24, eos, continuations=continuations, decoders=decoders)
    assert list(decoders.values()) == kept and len(kept) == 1, "the 48-token decoder was not reused"
    assert sorted(continuations) == [(8, 24), (8, 48)]
    assert alone.tau > 1.5 and longer.tokens > shorter.tokens
    for name in ("tokens", "diverged", "tau", "acceptance", "teacher_forced_acc", "teacher_forced_tau"):
        assert getattr(shorter, name) == getattr(alone, name), name
