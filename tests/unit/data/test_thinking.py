"""The thinking switch: --thinking resolves once against the chat template, training renders its
prompts in that mode and records it, data generated in another mode stops the preparation, and
Qwen3-style multi-turn conversations train every reply as serving renders it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dflash.data.chat_formats import DataError
from dflash.data.dataset import TokenDataset
from dflash.data.prepare import prepare_dataset
from dflash.data.thinking import resolve_thinking
from dflash.data.tokenization import prompt_ids, tokenize_conversation, conversation_sequences
from tiny_tokenizer import IM_END, make_thinking_tokenizer, make_tiny_tokenizer

EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def thinking():
    return make_thinking_tokenizer()


def write_records(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chat(*turns: tuple[str, str], **target_reply) -> dict:
    record = {"messages": [{"role": role, "content": content} for role, content in turns]}
    return {**record, "target_reply": target_reply} if target_reply else record


def test_auto_follows_the_templates_default_and_a_template_without_a_switch_is_none(thinking):
    assert [resolve_thinking(thinking, value) for value in ("auto", "on", "off")] == ["on", "on", "off"]
    chatml = make_tiny_tokenizer()
    assert [resolve_thinking(chatml, value) for value in ("auto", "on", "off")] == ["none"] * 3
    with pytest.raises(DataError, match="--thinking maybe: use one of auto, on, off"):
        resolve_thinking(thinking, "maybe")


@pytest.mark.parametrize("mode", ["on", "off"])
def test_training_renders_its_prompts_in_the_resolved_mode_and_records_it(thinking, tmp_path, mode):
    """Before, training rendered with the template's default whatever regeneration had used:
    thinking-off replies trained after a thinking-on prompt."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    path = write_records(tmp_path / "d.jsonl", [chat(("user", "Hi"), ("assistant", "Hello"), thinking=mode)])
    dataset = TokenDataset(prepare_dataset(path, thinking, tmp_path / "shard", 64, thinking=mode))
    ids, mask = dataset[0]
    prompt = prompt_ids(thinking, messages, enable_thinking=mode == "on")
    assert ids[: len(prompt)].tolist() == prompt and not mask[: len(prompt)].any()
    assert thinking.decode(ids[: len(prompt)]).endswith("assistant\n" + (EMPTY_THINK if mode == "off" else ""))
    assert dataset.manifest["thinking"] == mode


def test_a_changed_thinking_mode_prepares_the_shard_again(thinking, tmp_path):
    """With thinking on the template writes the (empty) think block as part of the reply, with
    it off the generation prompt does: the same file gives other sequences."""
    path = write_records(tmp_path / "d.jsonl", [chat(("user", "Hi"), ("assistant", "Hello"))])
    on = TokenDataset(prepare_dataset(path, thinking, tmp_path / "shard", 64, thinking="on"))
    ids, mask = on[0]
    assert "<think>" not in thinking.decode(ids[~mask]) and thinking.decode(ids[mask]).startswith(EMPTY_THINK)
    off = TokenDataset(prepare_dataset(path, thinking, tmp_path / "shard", 64, thinking="off"))
    ids, mask = off[0]
    assert off.manifest["thinking"] == "off" and EMPTY_THINK in thinking.decode(ids[~mask])


def test_data_generated_in_another_mode_stops_the_preparation_naming_both_and_the_flag(thinking, tmp_path):
    path = write_records(tmp_path / "d.jsonl", [chat(("user", "Hi"), ("assistant", "Hello"), thinking="on"),
                                                chat(("user", "Hi"), ("assistant", "Hello"), thinking="off")])
    with pytest.raises(DataError, match=rf"{path}:2: target_reply records thinking 'off', but this run renders "
                                        r"prompts with thinking 'on' .*pass --thinking off"):
        prepare_dataset(path, thinking, tmp_path / "shard", 64, thinking="on")
    with pytest.raises(DataError, match="thinking 'none'.*pass the --tokenizer"):
        prepare_dataset(path, make_tiny_tokenizer(), tmp_path / "shard", 64, thinking="none")


def test_qwen3_style_multi_turn_trains_every_reply_as_serving_renders_it(thinking, tmp_path):
    """The template drops the first reply's thinking once a later user turn follows, so the
    conversation is no prefix-stable render (before: skipped as such). Each reply trains in its
    own sequence: the conversation up to it with the generation prompt, then the reply."""
    turns = (("user", "Hi"), ("assistant", "<think>\nhmm\n</think>\n\nHello"), ("user", "how are you"),
             ("assistant", "The dog sat."))
    messages = chat(*turns)["messages"]
    first, second = conversation_sequences(thinking, messages, loss_turns="all", thinking="on")
    for (ids, mask), upto in ((first, 2), (second, 4)):
        prompt = prompt_ids(thinking, messages[: upto - 1], enable_thinking=True)
        assert ids[: len(prompt)].tolist() == prompt and not mask[: len(prompt)].any() and mask[len(prompt)]
    assert thinking.decode(first[0][first[1]]) == "<think>\nhmm\n</think>\n\nHello" + IM_END
    assert thinking.decode(second[0][second[1]]) == EMPTY_THINK + "The dog sat." + IM_END
    assert "hmm" not in thinking.decode(second[0])  # served, the second reply's prompt has no earlier thinking

    path = write_records(tmp_path / "d.jsonl", [chat(*turns)])
    dataset = TokenDataset(prepare_dataset(path, thinking, tmp_path / "shard", 128, loss_turns="all", thinking="on"))
    assert len(dataset) == 2 and dataset.manifest["stats"]["samples_split_by_turn"] == 1
    assert [dataset[i][0].tolist() for i in range(2)] == [first[0].tolist(), second[0].tolist()]


def test_a_prefix_stable_multi_turn_conversation_stays_one_sequence():
    chatml = make_tiny_tokenizer()
    messages = chat(("user", "Hi"), ("assistant", "Hello"), ("user", "how are you"), ("assistant", "The dog sat."))
    (ids, mask), = conversation_sequences(chatml, messages["messages"], loss_turns="all")
    want = tokenize_conversation(chatml, messages["messages"], loss_turns="all")
    assert np.array_equal(ids, want[0]) and np.array_equal(mask, want[1])
