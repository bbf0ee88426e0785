"""Every chat format a user brings trains on the same tokens: a file in each format is prepared
into a shard, and the shard's ids and loss masks equal those of the plain `messages` file, with
the loss on exactly the assistant text (tool calls included, as the template renders them)."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from dflash.tools.data import main as data_main
from dflash.data.dataset import TokenDataset
from dflash.data.prepare import prepare_dataset
from dflash.data.tokenization import load_tokenizer
from dflash.demo import DEMO_TARGET_DIR, DEMO_TRAIN_DATA
from tiny_tokenizer import IM_END, make_tiny_tokenizer

# Qwen2.5's tool rendering, cut down: calls as <tool_call> JSON inside the assistant turn, and
# consecutive tool replies in one user block. Jinja string literals understand "\n".
QWEN_STYLE_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif message.role == 'assistant' and message.tool_calls -%}"
    "{{- '<|im_start|>assistant' -}}"
    "{%- if message.content -%}{{- '\\n' + message.content -}}{%- endif -%}"
    "{%- for call in message.tool_calls -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' -}}"
    "{{- call.function.arguments | tojson + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

MULTI_TURN = [("system", "You are a cat."), ("user", "Look at this:\nWhat is the mat?"),
              ("assistant", "The mat is where\nthe cat sat."), ("user", "And the dog?"), ("assistant", "The dog ran.")]
SINGLE_TURN = [("user", "Hello"), ("assistant", "Hi there!")]
SHAREGPT_SPEAKERS = {"user": "human", "assistant": "gpt", "system": "system"}


def as_messages(turns, user="user", assistant="assistant") -> dict:
    names = {"user": user, "assistant": assistant}
    return {"messages": [{"role": names.get(role, role), "content": text} for role, text in turns]}


def as_parts(turns) -> dict:
    """OpenAI content parts: each line of a content its own text part (joined back with newlines)."""
    return {"messages": [{"role": role, "content": [{"type": "text", "text": line} for line in text.split("\n")]}
                         for role, text in turns]}


FORMATS = {
    "sharegpt": lambda turns: {"conversations": [{"from": SHAREGPT_SPEAKERS[r], "value": t} for r, t in turns]},
    "messages-human-gpt": lambda turns: as_messages(turns, "human", "gpt"),
    "openai-parts": as_parts,
    "prompt-response": lambda turns: {"prompt": turns[0][1], "response": turns[1][1]},
}


def write(path: Path, records: list[dict]) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in records).encode()
    path.write_bytes(gzip.compress(text) if path.suffix == ".gz" else text)
    return path


def samples(shard: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    dataset = TokenDataset(shard)
    return [dataset[i] for i in range(len(dataset))]


def masked_text(tokenizer, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """The decoded text of each contiguous run of loss-masked tokens."""
    runs = itertools.groupby(zip(ids, mask), key=lambda pair: bool(pair[1]))
    return [tokenizer.decode([i for i, _ in run]) for masked, run in runs if masked]


@pytest.mark.parametrize("name", [*FORMATS, "gzip"])
def test_each_format_trains_on_the_same_tokens_as_plain_messages(tmp_path, name):
    tokenizer = make_tiny_tokenizer()
    conversations = [SINGLE_TURN] if name == "prompt-response" else [MULTI_TURN, SINGLE_TURN]
    plain = write(tmp_path / "plain.jsonl", [as_messages(c) for c in conversations])
    other = (write(tmp_path / "plain.jsonl.gz", [as_messages(c) for c in conversations]) if name == "gzip"
             else write(tmp_path / f"{name}.jsonl", [FORMATS[name](c) for c in conversations]))
    want = samples(prepare_dataset(plain, tokenizer, tmp_path / "plain", 256, loss_turns="all"))
    got = samples(prepare_dataset(other, tokenizer, tmp_path / "other", 256, loss_turns="all"))

    assert len(got) == len(want) == len(conversations)
    for (ids, mask), (want_ids, want_mask), turns in zip(got, want, conversations):
        assert np.array_equal(ids, want_ids) and np.array_equal(mask, want_mask)
        assert masked_text(tokenizer, ids, mask) == [text + IM_END for role, text in turns if role == "assistant"]


def tool_conversation(arguments: list) -> dict:
    """Two parallel calls (OpenAI shape, content null), their two replies, the answer."""
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": args}}
             for i, args in enumerate(arguments)]
    return {"messages": [{"role": "user", "content": "Weather in Paris and Rome?"},
                         {"role": "assistant", "content": None, "tool_calls": calls},
                         {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
                         {"role": "tool", "tool_call_id": "call_1", "content": "rainy"},
                         {"role": "assistant", "content": "Sunny in Paris, rainy in Rome."}]}


CALLS_AS_RENDERED = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>')


@pytest.mark.parametrize("loss_turns", ["all", "last"])
def test_tool_calls_are_trained_as_the_template_renders_them(tmp_path, loss_turns):
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = QWEN_STYLE_TEMPLATE
    as_json = write(tmp_path / "openai.jsonl", [tool_conversation(['{"city": "Paris"}', '{"city":"Rome","days":2}'])])
    as_dicts = write(tmp_path / "dicts.jsonl", [tool_conversation([{"city": "Paris"}, {"city": "Rome", "days": 2}])])
    (ids, mask), = samples(prepare_dataset(as_json, tokenizer, tmp_path / "a", 1024, loss_turns=loss_turns))
    (same_ids, same_mask), = samples(prepare_dataset(as_dicts, tokenizer, tmp_path / "b", 1024, loss_turns=loss_turns))

    assert np.array_equal(ids, same_ids) and np.array_equal(mask, same_mask)
    answer = "Sunny in Paris, rainy in Rome." + IM_END
    assert masked_text(tokenizer, ids, mask) == ([CALLS_AS_RENDERED + IM_END, answer] if loss_turns == "all"
                                                 else [answer])
    context = tokenizer.decode(ids[~mask])
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrainy\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in context


def test_a_gzip_file_prepares_the_same_shard_as_the_plain_one_in_one_process_or_several(tmp_path):
    """The demo data (first 300 lines: the whole file gives the same, measured), gzip-compressed."""
    lines = DEMO_TRAIN_DATA.read_bytes().splitlines(keepends=True)[:300]
    plain, packed = tmp_path / "train.jsonl", tmp_path / "train.jsonl.gz"
    plain.write_bytes(b"".join(lines))
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    tokenizer = load_tokenizer(DEMO_TARGET_DIR)
    shards = [prepare_dataset(plain, tokenizer, tmp_path / "plain", 512, workers=1),
              prepare_dataset(packed, tokenizer, tmp_path / "gz", 512, workers=1),
              prepare_dataset(packed, tokenizer, tmp_path / "gz-pool", 512, workers=2)]
    for name in ("ids.bin", "loss_mask.bin"):
        assert len({(shard / name).read_bytes() for shard in shards}) == 1
    assert TokenDataset(shards[0]).manifest["stats"] == TokenDataset(shards[2]).manifest["stats"]


def test_a_sharegpt_gzip_file_goes_through_the_data_tool(tmp_path, capsys):
    """The issue's case: 40 ShareGPT conversations were refused ("expected either a 'messages'
    list"), and --max-bad-fraction 1 then blamed --max-length."""
    records = [FORMATS["sharegpt"]([("user", f"question {i}"), ("assistant", f"answer {i}")]) for i in range(40)]
    data = write(tmp_path / "sharegpt.jsonl.gz", records)
    assert data_main(["stats", "--train-data", str(data), "--output-dir", str(tmp_path / "run")]) == 0
    assert f"{data}: 40 samples read, 40 kept" in capsys.readouterr().out
