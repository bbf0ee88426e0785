"""Tiny random targets of every supported family: speculative decoding equals greedy decoding
(and the model's own generate()) in float32 past any sliding window, through rejected drafts
of every length; a few training steps run through train_drafter.py; a family that cannot work
is refused before any weight loads."""

from __future__ import annotations

import functools
import random
import subprocess
from pathlib import Path

import pytest
import torch
import transformers

import dflash.eval.speculative as speculative
from conftest import run_trainer, run_two_at_a_time, tiny_args, write_chat_jsonl
from dflash.target.frozen import FrozenTarget, TargetError, default_target_layer_ids, load_target_config
from dflash.target.static import FAST_FAMILIES, fast_decoding_supported
from tiny_tokenizer import make_tiny_tokenizer

WINDOW = 6
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
FAMILIES = {  # family -> (config class, model class, extra config)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral-sliding": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": WINDOW}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": WINDOW}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "qwen2-sliding": ("Qwen2Config", "Qwen2ForCausalLM",
                      {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
}
assert set(FAST_FAMILIES) <= {FAMILIES[f][0].removesuffix("Config").lower() for f in FAMILIES}
PROMPT = [60, 2, 2, 2, 71, 30, 8, 1, 90, 12, 13]
NEW_TOKENS = 32  # prompt + new tokens run far past the window


def tiny_family_model(family: str, vocab_size: int = 97):
    config_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(vocab_size=vocab_size, **COMMON, **extra)
    return getattr(transformers, model_name)(config).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_decoding_equals_greedy(family, monkeypatch):
    from conftest import tiny_drafter

    model = tiny_family_model(family).float()
    target = FrozenTarget(model, default_target_layer_ids(4, 2))
    greedy = speculative.greedy_decode(target, PROMPT, NEW_TOKENS, eos_ids=set())
    reference = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                               do_sample=False)[0, len(PROMPT):].tolist()
    assert greedy.tokens == reference
    block = 4
    drafter = tiny_drafter(target, block_size=block)
    full = PROMPT + greedy.tokens + [0] * 2 * block
    rng = random.Random(1)

    def oracle(session):  # right, then wrong at a random slot
        anchor = int(session._anchor)
        guess = list(full[anchor + 1: anchor + block])
        if rng.random() < 0.7:
            guess[rng.randrange(block - 1)] = (guess[0] + 1) % 90
        return torch.tensor(guess)

    monkeypatch.setattr(speculative.DraftSession, "_guess", oracle)
    kinds = ["plain", "fast"] if fast_decoding_supported(target) else ["plain"]
    for kind in kinds:
        spec = speculative.speculative_decode(target, drafter, PROMPT, NEW_TOKENS, eos_ids=set(), kind=kind)
        assert spec.tokens == greedy.tokens, kind
        assert min(spec.accepted) < block - 1 < max(spec.accepted) + 1  # rejections and full accepts
    if "fast" in kinds:
        assert speculative.greedy_decode(target, PROMPT, NEW_TOKENS, set(), kind="fast").tokens == reference
    else:
        assert speculative.resolve_decoder("auto", target) == "plain"
        with pytest.raises(TargetError, match="use --decoder plain"):
            speculative.greedy_decode(target, PROMPT, NEW_TOKENS, set(), kind="fast")


@pytest.fixture(scope="module")
def training_runs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Family -> (its run of a few steps through train_drafter.py, its output dir); the runs go
    two at a time."""
    tokenizer = make_tiny_tokenizer()
    runs = {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(family)
        tiny_family_model(family, vocab_size=len(tokenizer) + 3).save_pretrained(root / "target")
        tokenizer.save_pretrained(root / "target")
        setup = {"target": root / "target", "train": write_chat_jsonl(root / "train.jsonl", 16, 0)}
        args = tiny_args(setup, root / "run", "--target-layer-ids", "1", "2")
        args[args.index("--max-steps") + 1] = "2"
        runs[family] = args, root / "run"
    procs = run_two_at_a_time({family: functools.partial(run_trainer, args) for family, (args, _) in runs.items()})
    return {family: (procs[family], out) for family, (_, out) in runs.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_few_training_steps(family, training_runs):
    proc, out = training_runs[family]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "drafter" / "model.safetensors").is_file()


def test_a_family_that_cannot_work_is_refused_before_loading(tmp_path):
    transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(TargetError, match="gpt2 config has no intermediate_size"):
        load_target_config(str(tmp_path / "gpt2"))
    transformers.T5Config(d_model=32, num_layers=1, num_heads=2).save_pretrained(tmp_path / "t5")
    with pytest.raises(TargetError, match="t5 is an encoder-decoder model"):
        load_target_config(str(tmp_path / "t5"))
