"""A tokenizer must belong to its target (dflash/data/tokenizer_match.py): its ids fit the
embedding rows, its special ids are the ones the target's configs name, and its vocabulary is the
target's own tokenizer's where the target ships one. Another model's tokenizer trains without any
error otherwise. Read from config files only: no weights are written."""

from __future__ import annotations

import logging

import pytest
from transformers import GenerationConfig, Qwen3Config

from dflash.data.tokenizer_match import OVERRIDE_FLAG, check_tokenizer_matches_target
from dflash.util.cli import ConfigError
from tiny_tokenizer import _MERGED_WORDS, make_tiny_tokenizer


def target_folder(path, rows: int, with_tokenizer: bool = True, generation: GenerationConfig | None = None,
                  **special_ids) -> str:
    """A target's config (and tokenizer, generation config) without its weights: what the checks read."""
    Qwen3Config(vocab_size=rows, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, **special_ids).save_pretrained(path)
    if with_tokenizer:
        make_tiny_tokenizer().save_pretrained(path)
    if generation is not None:
        generation.save_pretrained(path)
    return str(path)


def other_model_tokenizer(path) -> str:
    """Same size and special tokens as the tiny tokenizer; its merged words got other ids."""
    make_tiny_tokenizer(words=_MERGED_WORDS[::-1]).save_pretrained(path)
    return str(path)


def test_the_target_with_its_own_tokenizer_passes(tmp_path):
    target = target_folder(tmp_path / "t", 330, eos_token_id=2, pad_token_id=0)
    check_tokenizer_matches_target(make_tiny_tokenizer(), target, target)


def test_more_tokens_than_embedding_rows_is_refused_whatever_the_flag(tmp_path):
    target = target_folder(tmp_path / "t", 300, with_tokenizer=False)
    for allow in (False, True):
        with pytest.raises(ConfigError, match=f"--tokenizer tok and --target {target} do not belong together: size: "
                                              "--tokenizer has 325 tokens, more than the target's 300 embedding rows "
                                              r".*no flag overrides the size check"):
            check_tokenizer_matches_target(make_tiny_tokenizer(), target, "tok", allow_mismatch=allow)


def test_special_ids_must_be_among_those_the_configs_name(tmp_path):
    tokenizer = make_tiny_tokenizer()  # eos 2 (<|im_end|>), pad 0, no bos
    wrong = target_folder(tmp_path / "wrong", 330, with_tokenizer=False, eos_token_id=5, pad_token_id=1, bos_token_id=1)
    with pytest.raises(ConfigError) as refused:
        check_tokenizer_matches_target(tokenizer, wrong, "tok")
    message = str(refused.value)
    assert ("special ids: --tokenizer's end-of-sequence token '<|im_end|>' is id 2, but the target's config names "
            "eos_token_id [5]") in message
    assert "special ids: --tokenizer's padding token '<|endoftext|>' is id 0" in message
    assert "pad_token_id [1]" in message
    assert "beginning-of-sequence" not in message  # the tokenizer has none: nothing to compare
    assert f"or pass {OVERRIDE_FLAG} if the difference is deliberate" in message
    # the generation config may name more end-of-sequence ids (a list), as instruct models' do
    listed = target_folder(tmp_path / "listed", 330, with_tokenizer=False, eos_token_id=7,
                           generation=GenerationConfig(eos_token_id=[7, 2]))
    check_tokenizer_matches_target(tokenizer, listed, "tok")


def test_a_vocabulary_other_than_the_targets_own_is_refused_unless_allowed(tmp_path, caplog):
    target = target_folder(tmp_path / "t", 330, eos_token_id=2)
    other = other_model_tokenizer(tmp_path / "other")
    with pytest.raises(ConfigError, match=r"vocabulary: 65 of the first 325 ids name other tokens than in the "
                                          r"tokenizer the target ships \(e\.g\. id 259: .* in --tokenizer, .* in the "
                                          rf"target's\).*or pass {OVERRIDE_FLAG}"):
        check_tokenizer_matches_target(make_tiny_tokenizer(words=_MERGED_WORDS[::-1]), target, other)
    with caplog.at_level(logging.WARNING):
        check_tokenizer_matches_target(make_tiny_tokenizer(words=_MERGED_WORDS[::-1]), target, other,
                                       allow_mismatch=True)
    assert f"({OVERRIDE_FLAG}): vocabulary: 65 of the first 325 ids" in caplog.text


def test_a_tokenizer_that_extends_the_targets_own_within_its_rows_passes(tmp_path):
    """An added mask token (or a GGUF's padding rows) lies past the other tokenizer's ids."""
    target = target_folder(tmp_path / "t", 330, eos_token_id=2)
    extended = make_tiny_tokenizer()
    extended.add_special_tokens({"mask_token": "<|mask|>"})
    check_tokenizer_matches_target(extended, target, str(tmp_path / "extended"))
