"""Tests for dflash/data/chat_formats.py through load_chat_jsonl: every chat format a user brings
reads as the same messages, and every record it cannot read is refused naming file:line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from dflash.config import EVAL_FLAGS, check_eval_flags
from dflash.data.chat_formats import DataError, TEXT_PART_SEPARATOR, load_chat_jsonl
from dflash.data.prepare import prepare_dataset
from tiny_tokenizer import make_tiny_tokenizer

PLAIN = [{"role": "system", "content": "You are a cat."}, {"role": "user", "content": "What is the mat?"},
         {"role": "assistant", "content": "The mat is where the cat sat."}]


def write_jsonl(path: Path, records: list) -> Path:
    """Records one per line (dicts as JSON, strings verbatim); gzip-compressed for a .gz name."""
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records).encode()
    path.write_bytes(gzip.compress(text) if path.suffix == ".gz" else text)
    return path


def load_one(tmp_path: Path, record: dict, require_reply: bool = True) -> list[dict]:
    (messages,) = load_chat_jsonl(write_jsonl(tmp_path / "d.jsonl", [record]), require_reply)
    return messages


def tool_chat(arguments) -> dict:
    """A user question, an assistant turn that only calls a tool (content null, as OpenAI
    writes it), the tool's reply, and the final answer."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return {"messages": [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                         {"role": "assistant", "content": "It is sunny."}]}


# ---------------------------------------------------------------------------
# Accepted: each format reads as the plain messages


@pytest.mark.parametrize("record", [
    {"conversations": [{"from": "system", "value": "You are a cat."}, {"from": "human", "value": "What is the mat?"},
                       {"from": "gpt", "value": "The mat is where the cat sat."}]},
    {"conversations": [{"from": "system", "value": "You are a cat."}, {"from": "user", "value": "What is the mat?"},
                       {"from": "assistant", "value": "The mat is where the cat sat."}]},
    {"conversations": PLAIN},  # role/content turns under the ShareGPT key
    {"messages": [{"role": "system", "content": "You are a cat."}, {"role": "human", "content": "What is the mat?"},
                  {"role": "gpt", "content": "The mat is where the cat sat."}]},
    {"messages": [{"role": "system", "content": [{"type": "text", "text": "You are a cat."}]},
                  {"role": "user", "content": [{"type": "text", "text": "What is the mat?"}]},
                  {"role": "assistant", "content": "The mat is where the cat sat."}]},
], ids=["sharegpt", "sharegpt-user-assistant", "conversations-role-content", "messages-human-gpt", "openai-parts"])
def test_every_format_reads_as_the_plain_messages(tmp_path, record):
    assert load_one(tmp_path, record) == PLAIN


def test_text_parts_are_joined_in_order_with_a_newline(tmp_path):
    parts = [{"type": "text", "text": "Look:"}, {"type": "text", "text": "the cat"}, {"type": "text", "text": ""}]
    messages = load_one(tmp_path, {"messages": [{"role": "user", "content": parts}, PLAIN[2]]})
    assert TEXT_PART_SEPARATOR == "\n" and messages[0]["content"] == "Look:\nthe cat\n"


@pytest.mark.parametrize("arguments", ['{"city": "Paris"}', {"city": "Paris"}])
def test_tool_calls_reach_the_template_in_its_form(tmp_path, arguments):
    """Arguments become a dict (templates apply tojson), null content "", the tool reply keeps its call id."""
    messages = load_one(tmp_path, tool_chat(arguments))
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize(("call", "arguments"), [
    ({"function": {"name": "now"}}, {}),  # no type, no arguments
    ({"type": "function", "function": {"name": "now", "arguments": ""}}, {}),
    ({"type": "function", "function": {"name": "now", "arguments": None}}, {}),
])
def test_a_call_without_arguments_has_empty_ones(tmp_path, call, arguments):
    record = {"messages": [PLAIN[1], {"role": "assistant", "content": "Let me look.", "tool_calls": [call]}]}
    assert load_one(tmp_path, record)[1]["tool_calls"] == [
        {"type": "function", "function": {"name": "now", "arguments": arguments}}]


def test_an_empty_tool_calls_list_is_no_call(tmp_path):
    record = {"messages": [PLAIN[1], {"role": "assistant", "content": "Hi", "tool_calls": []}]}
    assert load_one(tmp_path, record)[1] == {"role": "assistant", "content": "Hi"}


def test_what_regeneration_writes_reads_back_unchanged(tmp_path):
    """dflash.regenerate writes the messages it read as {"messages": [...]}: they must load as themselves."""
    messages = load_one(tmp_path, tool_chat('{"city": "Paris"}'))
    assert load_one(tmp_path, {"messages": messages}) == messages


def test_sharegpt_prompts_load_for_evaluation_and_regeneration(tmp_path):
    path = write_jsonl(tmp_path / "prompts.jsonl.gz", [{"conversations": [{"from": "human", "value": "hi"}]}] * 3)
    check_eval_flags(str(path), 3, 8, "float32", EVAL_FLAGS, min_prompts=1)  # dflash.eval's start-up check
    assert load_chat_jsonl(path, require_reply=False) == [[{"role": "user", "content": "hi"}]] * 3


# ---------------------------------------------------------------------------
# Refused: one clear line naming file:line


def user_then(assistant: dict) -> dict:
    return {"messages": [PLAIN[1], {"role": "assistant", **assistant}]}


@pytest.mark.parametrize(("record", "fragment"), [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                                 {"type": "image_url", "image_url": {"url": "x.png"}}]}, PLAIN[2]]},
     "messages[0].content[1]: image parts are not supported: the drafter trains on text; drop the image or the sample"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}, PLAIN[2]]},
     "audio parts are not supported"),
    ({"messages": [{"role": "user", "content": ["hi"]}, PLAIN[2]]},
     "messages[0].content[0] must be a {'type': 'text', 'text': ...} object"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "bing", "value": "x"}]},
     "conversations[1]: unknown role 'bing'; expected one of"),
    ({"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "x"}]},
     "conversations[0]: 'value' must be a string or a list of text parts, got int"),
    ({"conversations": []}, "'conversations' must be a non-empty list"),
    ({"messages": [PLAIN[1]], "conversations": [PLAIN[1]]}, "expected exactly one of a 'messages' list"),
    ({"messages": [{"role": "user", "content": None}, PLAIN[2]]},
     "messages[0]: 'content' is null or missing; only an assistant turn with tool_calls may have no content"),
    (user_then({"content": None}), "messages[1]: 'content' is null or missing"),
    (user_then({"content": "  ", "tool_calls": []}), "assistant turn 1 (counting from 0) has empty content"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [{"function": {"name": "f"}}]}, PLAIN[2]]},
     "messages[0]: a user turn has tool_calls; only assistant turns call tools"),
    (user_then({"content": None, "tool_calls": {"function": {"name": "f"}}}), "'tool_calls' must be a list"),
    (user_then({"content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}),
     "messages[1].tool_calls[0] must be {'type': 'function', 'function': {'name': ..., 'arguments': ...}}"),
    (user_then({"content": None, "tool_calls": [{"type": "code_interpreter", "function": {"name": "f"}}]}),
     "messages[1].tool_calls[0] must be {'type': 'function'"),
    (user_then({"content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{city: Paris}"}}]}),
     "messages[1].tool_calls[0].function.arguments is not valid JSON"),
    (user_then({"content": None, "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]}),
     "messages[1].tool_calls[0].function.arguments must be a JSON object, got list"),
    ({"messages": [PLAIN[1], PLAIN[2], {"role": "tool", "content": "x", "tool_call_id": 7}]},
     "messages[2]: 'tool_call_id' must be a string, got int"),
])
def test_unreadable_records_are_refused_naming_file_line_and_turn(tmp_path, record, fragment):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "response": "b"}, record])
    with pytest.raises(DataError) as excinfo:
        load_chat_jsonl(path)
    assert f"{path}:2: " in str(excinfo.value) and fragment in str(excinfo.value), str(excinfo.value)


def test_a_template_that_drops_tool_calls_is_refused_naming_the_line(tmp_path):
    """The tiny ChatML template renders content only: the call would vanish from the trained turn."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "response": "b"}, tool_chat("{}")])
    with pytest.raises(DataError, match=f"{path}:2: assistant turn messages\\[1\\]: the chat template does not "
                                        "render its tool call 'get_weather'"):
        prepare_dataset(path, make_tiny_tokenizer(), tmp_path / "shard", 64, on_bad_sample="error", loss_turns="all")


def test_a_truncated_gzip_file_is_refused_naming_it(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl.gz", [{"prompt": "a", "response": "b"}] * 200)
    path.write_bytes(path.read_bytes()[:-8])  # cut before the CRC and length that end the stream
    with pytest.raises(DataError, match=f"{path}: cannot read past line 200 .*cut short: copy it again"):
        load_chat_jsonl(path)


def test_a_gz_name_on_a_plain_file_still_reads(tmp_path):
    path = tmp_path / "regen.jsonl.gz"
    path.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    assert load_chat_jsonl(path) == [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]]


# ---------------------------------------------------------------------------
# When nothing is left to train on, the message names the real reason


def test_all_bad_samples_say_so_and_not_that_they_were_too_long(tmp_path):
    """--max-bad-fraction 1 used to skip them all and then blame --max-length."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a story"}] * 40)
    with pytest.raises(DataError) as excinfo:
        prepare_dataset(path, make_tiny_tokenizer(), tmp_path / "shard", 64, max_bad_fraction=1)
    message = str(excinfo.value)
    assert "all 40 samples are bad (not a conversation: 40)" in message
    assert f"{path}:1: expected exactly one of a 'messages' list" in message
    assert "would leave nothing to train on" in message and "--max-length" not in message


def test_nothing_left_names_both_the_dropped_and_the_bad(tmp_path):
    long = {"prompt": "the dog " * 30, "response": "Hi"}
    path = write_jsonl(tmp_path / "d.jsonl", [long] * 3 + ["{oops"])
    with pytest.raises(DataError) as excinfo:
        prepare_dataset(path, make_tiny_tokenizer(), tmp_path / "shard", 8, max_bad_fraction=0.5)
    assert str(excinfo.value) == (f"{path}: no sample left to train on: 3 of 4 were dropped at --max-length=8 "
                                  "(no assistant token within it; raise --max-length), and the other 1 are bad "
                                  "(malformed JSON: 1)")

