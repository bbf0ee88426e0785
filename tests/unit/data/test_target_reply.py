"""Faithful replies: a record's target_reply (what regeneration recorded) decides what trains. The
emitted token ids follow the prompt's ids as they are, a reply cut at the length limit is never
closed with an end-of-turn token, --cut-replies drop (the default) leaves such replies out and counts them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash.data.chat_formats import DataError, TargetReply
from dflash.data.dataset import TokenDataset
from dflash.data.prepare import prepare_dataset
from dflash.data.tokenization import prompt_ids, tokenize_conversation
from tiny_tokenizer import IM_END, make_tiny_tokenizer

PROMPT = [{"role": "user", "content": "What is the mat?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


def record(reply: str, **target_reply) -> dict:
    return {"messages": [*PROMPT, {"role": "assistant", "content": reply}], "target_reply": target_reply}


def prepare(tokenizer, tmp_path: Path, records: list[dict], **settings) -> TokenDataset:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return TokenDataset(prepare_dataset(path, tokenizer, tmp_path / "shard", 64, **settings))


def byte_ids(tokenizer, text: str) -> list[int]:
    """`text` one byte-level symbol per token: a split the tokenizer's merges never give."""
    words = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
    return tokenizer.convert_tokens_to_ids(list("".join(word for word, _ in words)))


def test_training_uses_the_emitted_ids_where_tokenizing_the_text_again_differs(tokenizer, tmp_path):
    """The target wrote "The cat sat." byte by byte; tokenized again, the text merges into
    whole words. Before, training re-tokenized the text."""
    end = tokenizer.convert_tokens_to_ids(IM_END)
    emitted = [*byte_ids(tokenizer, "The cat sat."), end]
    assert tokenizer.decode(emitted[:-1]) == "The cat sat."
    retokenized = tokenize_conversation(tokenizer, record("The cat sat.")["messages"])
    assert retokenized[0][retokenized[1]].tolist() != emitted  # the seam this test is about
    ids, mask = prepare(tokenizer, tmp_path, [record("The cat sat.", token_ids=emitted, finish_reason="stop")])[0]
    prompt = prompt_ids(tokenizer, PROMPT)
    assert ids.tolist() == prompt + emitted
    assert mask.tolist() == [False] * len(prompt) + [True] * len(emitted)  # the stop token trains too


@pytest.mark.parametrize("with_ids", [True, False], ids=["token_ids", "text"])
def test_a_cut_reply_is_never_closed_with_an_end_of_turn_token(tokenizer, tmp_path, with_ids):
    """finish_reason "length": the target had not finished. Before, the template closed the reply
    with <|im_end|>, and the drafter learnt to end turns where the target does not."""
    text = "The mat is where the cat sat on"
    ids_field = {"token_ids": tokenizer(text, add_special_tokens=False)["input_ids"]} if with_ids else {}
    ids, mask = prepare(tokenizer, tmp_path, [record(text, finish_reason="length", **ids_field)], cut_replies="keep")[0]
    prompt = prompt_ids(tokenizer, PROMPT)
    end = tokenizer.convert_tokens_to_ids(IM_END)
    assert ids[: len(prompt)].tolist() == prompt and not mask[: len(prompt)].any()
    assert mask[len(prompt):].all() and end not in ids[len(prompt):]
    assert tokenizer.decode(ids[len(prompt):]) == text


def test_cut_replies_drop_leaves_them_out_counted_and_the_setting_keys_the_cache(tokenizer, tmp_path):
    records = [record("The cat sat.", finish_reason="stop"), record("The cat sat on", finish_reason="length"),
               record("Hello")]
    kept = prepare(tokenizer, tmp_path, records, cut_replies="keep")
    assert len(kept) == 3 and kept.manifest["stats"]["samples_cut"] == 1 and kept.manifest["cut_replies"] == "keep"
    dropped = prepare(tokenizer, tmp_path, records)  # the default
    stats = dropped.manifest["stats"]
    assert len(dropped) == 2 and dropped.manifest["cut_replies"] == "drop"
    assert (stats["samples_cut"], stats["samples_cut_dropped"], stats["samples_bad"]) == (1, 1, 0)
    with pytest.raises(DataError, match="1 were replies cut at the regeneration's length limit.*--cut-replies keep"):
        prepare(tokenizer, tmp_path, records[1:2], cut_replies="drop")


def test_earlier_turns_still_train_from_the_template_beside_emitted_ids(tokenizer):
    """--loss-turns all with a prefix-stable template: one sequence, the earlier reply located in
    the final reply's prompt, the final reply the emitted ids."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "how are you"}, {"role": "assistant", "content": "The dog sat."}]
    emitted = byte_ids(tokenizer, "The dog sat.")  # cut: no stop token
    ids, mask = tokenize_conversation(tokenizer, messages, loss_turns="all",
                                      reply=TargetReply(emitted, "length", "none"))
    prompt = prompt_ids(tokenizer, messages)
    assert ids.tolist() == prompt + emitted and mask[len(prompt):].all()
    assert tokenizer.decode(ids[: len(prompt)][mask[: len(prompt)]]) == "Hello" + IM_END


@pytest.mark.parametrize("target_reply, reason", [
    ({"finish_reason": "maybe"}, "bad target_reply"),
    ({"token_ids": [1, -2]}, "bad target_reply"),
    ({"thinking": "sometimes"}, "bad target_reply"),
    ({"token_ids": [10**6]}, "token id out of range"),
])
def test_a_bad_target_reply_is_a_bad_sample_naming_the_field(tokenizer, tmp_path, target_reply, reason):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(record("Hello", **target_reply)) + "\n")
    with pytest.raises(DataError, match=rf"{path}:1: .*(target_reply|token_ids)"):
        prepare_dataset(path, tokenizer, tmp_path / "shard", 64, on_bad_sample="error")
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(record("Hello")) + "\n" + json.dumps(record("Hello", **target_reply)) + "\n")
    shard = TokenDataset(prepare_dataset(good, tokenizer, tmp_path / "shard2", 64, max_bad_fraction=0.5))
    assert len(shard) == 1 and shard.manifest["stats"]["bad_reasons"] == {reason: 1}
