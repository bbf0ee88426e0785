"""Tests for dflash.data: JSONL loading, loss masks, shards, batching, collation."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash.data import prepare, shards, tokenization
from dflash.data.chat_formats import DataError, load_chat_jsonl
from dflash.data.dataset import TokenDataset, collate
from dflash.data.prepare import prepare_dataset
from dflash.data.tokenization import load_tokenizer, tokenize_conversation
from dflash.demo import DEMO_TRAIN_DATA
from dflash.drafter.objective import anchor_candidates
from tiny_tokenizer import IM_END, IM_START, make_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


def write_jsonl(path: Path, records: list) -> Path:
    """Write records (dicts as JSON, strings verbatim) one per line."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def chat(*turns: tuple[str, str]) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


def masked_runs(ids: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
    """Token ids of each contiguous run of True in mask."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [ids[start:stop] for start, stop in zip(edges[::2], edges[1::2])]


SAMPLES = [
    chat(("user", "Hello"), ("assistant", "Hi there!")),
    chat(("system", "You are a cat."), ("user", "What is the mat?"),
         ("assistant", "The mat is where the cat sat.\nÜnïcode 🐱 ok")),
    chat(("user", "Hi"), ("assistant", "Hello"), ("user", "how are you"), ("assistant", "The dog sat.")),
    {"prompt": "help me", "response": "  leading spaces and a tab\tend"},
]


# ---------------------------------------------------------------------------
# Tokenization and loss mask


def test_loss_mask_covers_reply_and_end_token_only(tokenizer):
    messages = SAMPLES[1]["messages"]
    ids, mask = tokenize_conversation(tokenizer, messages)

    assert ids.dtype == np.int32 and mask.dtype == np.bool_ and ids.shape == mask.shape
    assert tokenizer.decode(ids[mask]) == messages[2]["content"] + IM_END
    first = int(np.argmax(mask))
    prompt_text = tokenizer.decode(ids[:first])
    assert prompt_text.endswith(f"{IM_START}assistant\n")
    assert "You are a cat." in prompt_text and "What is the mat?" in prompt_text
    # Only the newline the template writes after the end token is left unmasked at the end.
    assert tokenizer.decode(ids[first + int(mask.sum()) :]) == "\n"
    assert tokenizer.convert_tokens_to_ids(IM_START) not in ids[mask]


def test_the_last_assistant_turn_is_masked_or_every_one(tokenizer):
    """Regeneration rewrites only the final reply: by default earlier replies stay out of the loss."""
    messages = SAMPLES[2]["messages"]
    ids, mask = tokenize_conversation(tokenizer, messages)
    assert [tokenizer.decode(run) for run in masked_runs(ids, mask)] == ["The dog sat." + IM_END]
    ids_all, mask_all = tokenize_conversation(tokenizer, messages, loss_turns="all")
    assert np.array_equal(ids_all, ids)
    runs = [tokenizer.decode(run) for run in masked_runs(ids_all, mask_all)]
    assert runs == ["Hello" + IM_END, "The dog sat." + IM_END]
    assert "how are you" in tokenizer.decode(ids_all[~mask_all])


def test_a_changed_loss_turns_flag_prepares_the_shard_again(tokenizer, tmp_path):
    path = tmp_path / "multi.jsonl"
    path.write_text(json.dumps(SAMPLES[2]) + "\n")
    last = TokenDataset(prepare_dataset(path, tokenizer, tmp_path / "shard", max_length=64))
    every = TokenDataset(prepare_dataset(path, tokenizer, tmp_path / "shard", max_length=64, loss_turns="all"))
    assert int(every.manifest["stats"]["num_loss_tokens"]) > int(last.manifest["stats"]["num_loss_tokens"])


def test_turns_after_last_reply_are_dropped(tokenizer):
    messages = SAMPLES[0]["messages"] + [{"role": "user", "content": "one more thing"}]
    ids, _ = tokenize_conversation(tokenizer, messages)

    assert np.array_equal(ids, tokenize_conversation(tokenizer, SAMPLES[0]["messages"])[0])


def test_reply_as_first_turn_is_rejected(tokenizer):
    with pytest.raises(DataError, match="starts with an assistant turn"):
        tokenize_conversation(tokenizer, [{"role": "assistant", "content": "Hi"}])


def test_prompt_response_equals_messages_form(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "Hello", "response": "Hi there!"},
        SAMPLES[0],
    ])
    pair, messages = load_chat_jsonl(path)

    assert pair == messages
    for got, want in zip(tokenize_conversation(tokenizer, pair), tokenize_conversation(tokenizer, messages)):
        assert np.array_equal(got, want)


def test_tokenizer_without_template_is_rejected(tmp_path):
    plain = make_tiny_tokenizer(chat_template=False)
    with pytest.raises(DataError, match="--tokenizer"):
        tokenize_conversation(plain, SAMPLES[0]["messages"])
    path = write_jsonl(tmp_path / "d.jsonl", [SAMPLES[0]])
    with pytest.raises(DataError, match="--tokenizer"):
        prepare_dataset(path, plain, tmp_path / "shard", max_length=64)


def test_load_tokenizer_round_trip(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path / "tok")
    loaded = load_tokenizer(tmp_path / "tok")

    text = "Hello, the cat sat. Ünïcode 🐱"
    assert loaded.chat_template == tokenizer.chat_template
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.pad_token_id == tokenizer.pad_token_id


def test_load_tokenizer_errors_name_the_flag(tmp_path):
    with pytest.raises(DataError, match="--tokenizer"):
        load_tokenizer(tmp_path / "missing")
    make_tiny_tokenizer(chat_template=False).save_pretrained(tmp_path / "plain")
    with pytest.raises(DataError, match="no chat_template.*--tokenizer"):
        load_tokenizer(tmp_path / "plain")


def test_template_that_is_not_prefix_stable_is_rejected(tmp_path):
    unstable = make_tiny_tokenizer()
    # The generation prompt opens a block that the rendered reply never contains.
    unstable.chat_template = unstable.chat_template.replace(
        "'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'"
    )
    with pytest.raises(DataError, match="prefix-stable"):
        tokenize_conversation(unstable, SAMPLES[0]["messages"])
    path = write_jsonl(tmp_path / "d.jsonl", ["", SAMPLES[0]])
    with pytest.raises(DataError, match=f"{path}:2"):
        prepare_dataset(path, unstable, tmp_path / "shard", max_length=64)


# ---------------------------------------------------------------------------
# JSONL validation


def test_load_skips_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["", SAMPLES[0], "   ", SAMPLES[3]])
    loaded = load_chat_jsonl(path)

    assert loaded == [
        SAMPLES[0]["messages"],
        [{"role": "user", "content": "help me"},
         {"role": "assistant", "content": "  leading spaces and a tab\tend"}],
    ]


GOOD = json.dumps(SAMPLES[0])


@pytest.mark.parametrize(
    ("lines", "lineno", "fragment"),
    [
        ([GOOD, "{not json"], 2, "malformed JSON"),
        ([GOOD, "", "[1, 2]"], 3, "JSON object"),
        (["null"], 1, "JSON object"),
        (['{"text": "hi"}'], 1, "'messages'"),
        (['{"prompt": "a"}'], 1, "'response' must be a string"),
        (['{"prompt": "a", "response": 3}'], 1, "'response' must be a string"),
        ([json.dumps({"prompt": "a", "response": "b", **chat(("assistant", "x"))})], 1, "exactly one of"),
        (['{"messages": []}'], 1, "non-empty list"),
        (['{"messages": "hi"}'], 1, "non-empty list"),
        (['{"messages": ["hi"]}'], 1, "messages[0] must be an object"),
        ([json.dumps(chat(("user", "a"), ("assistant", 5)))], 1, "'content' must be a string"),
        (['{"messages": [{"content": "a"}]}'], 1, "'role' must be a string"),
        ([GOOD, json.dumps(chat(("user", "a"), ("robot", "b")))], 2, "unknown role 'robot'"),
        ([json.dumps(chat(("system", "s"), ("user", "a")))], 1, "no assistant turn"),
        ([json.dumps(chat(("user", "a"), ("assistant", " \n")))], 1, "empty content"),
        (['{"prompt": "a", "response": ""}'], 1, "empty content"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, lines, lineno, fragment):
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    with pytest.raises(DataError) as excinfo:
        load_chat_jsonl(path)

    assert f"{path}:{lineno}" in str(excinfo.value)
    assert fragment in str(excinfo.value)


def test_prompts_may_end_in_a_user_turn_but_training_data_may_not(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"id": "c:0", **chat(("system", "s"), ("user", "a"))},  # extra keys are ignored
        chat(("user", "a"), ("assistant", "b"), ("user", "c")),
        {"prompt": "help me"},
        {"prompt": "a", "response": ""},  # the reply is replaced, so it may be empty
    ])
    assert load_chat_jsonl(path, require_reply=False) == [
        chat(("system", "s"), ("user", "a"))["messages"],
        chat(("user", "a"), ("assistant", "b"), ("user", "c"))["messages"],
        [{"role": "user", "content": "help me"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}],
    ]
    with pytest.raises(DataError, match=f"{path}:1: conversation has no assistant turn.*dflash.regenerate"):
        load_chat_jsonl(path)


@pytest.mark.parametrize(("line", "fragment"), [
    (json.dumps(chat(("assistant", "x"))), "only assistant turns, so no prompt"),
    ('{"prompt": 3}', "'prompt' must be a string"),
    ('{"prompt": "a", "response": 3}', "'response' must be a string"),
    ('{"response": "a"}', "'prompt' must be a string"),
])
def test_bad_prompt_lines_name_file_and_line(tmp_path, line, fragment):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, line])
    with pytest.raises(DataError, match=f"{path}:2: .*{fragment}"):
        load_chat_jsonl(path, require_reply=False)


def test_invalid_utf8_names_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + b'{"prompt": "\xff"}\n')
    with pytest.raises(DataError, match=f"{path}:2: not valid UTF-8"):
        load_chat_jsonl(path)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=f"{path}: cannot open"):
        load_chat_jsonl(path)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=f"{path}: no conversations"):
        load_chat_jsonl(path)


def test_bad_line_during_prepare_names_line(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD, "{oops"])
    with pytest.raises(DataError, match=f"{path}:3"):
        prepare_dataset(path, tokenizer, tmp_path / "shard", max_length=64)
    assert not (tmp_path / "shard").exists()


# ---------------------------------------------------------------------------
# Shard preparation


@pytest.fixture()
def overflow_case(tokenizer, tmp_path):
    """One short sample, one with a long reply, one whose prompt alone fills max_length."""
    records = [
        chat(("user", "Hi"), ("assistant", "Hello")),
        chat(("user", "Hi"), ("assistant", "the cat sat on the mat " * 10)),
        chat(("user", "the dog " * 30), ("assistant", "Hi")),
    ]
    max_length = 30
    encoded = [tokenize_conversation(tokenizer, r["messages"]) for r in records]
    (short_ids, _), (long_ids, long_mask), (_, late_mask) = encoded
    assert len(short_ids) <= max_length
    assert np.argmax(long_mask) < max_length < len(long_ids)
    assert np.argmax(late_mask) >= max_length
    return write_jsonl(tmp_path / "d.jsonl", records), max_length, encoded


def test_truncate_counts_and_cuts(tokenizer, tmp_path, overflow_case, caplog):
    path, max_length, encoded = overflow_case
    with caplog.at_level(logging.WARNING, logger="dflash.data"):
        ds = TokenDataset(prepare_dataset(path, tokenizer, tmp_path / "shard", max_length))

    stats = ds.manifest["stats"]
    (short_ids, short_mask), (long_ids, long_mask), _ = encoded
    assert (stats["samples_read"], stats["samples_kept"]) == (3, 2)
    assert (stats["samples_truncated"], stats["samples_dropped"]) == (1, 1)
    assert stats["num_tokens"] == len(short_ids) + max_length
    assert stats["num_loss_tokens"] == short_mask.sum() + long_mask[:max_length].sum()
    assert np.array_equal(ds[1][0], long_ids[:max_length])
    assert np.array_equal(ds[1][1], long_mask[:max_length])
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_drop_counts(tokenizer, tmp_path, overflow_case):
    path, max_length, encoded = overflow_case
    ds = TokenDataset(prepare_dataset(path, tokenizer, tmp_path / "shard", max_length, "drop"))

    stats = ds.manifest["stats"]
    assert (stats["samples_read"], stats["samples_kept"]) == (3, 1)
    assert (stats["samples_truncated"], stats["samples_dropped"]) == (0, 2)
    assert np.array_equal(ds[0][0], encoded[0][0])


def test_everything_dropped_is_an_error(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [chat(("user", "the dog " * 30), ("assistant", "Hi"))])
    with pytest.raises(DataError, match="--max-length"):
        prepare_dataset(path, tokenizer, tmp_path / "shard", max_length=8)
    assert not (tmp_path / "shard").exists()


@pytest.mark.parametrize(
    ("overflow", "max_length", "flag"), [("wrap", 64, "--overflow"), ("drop", 0, "--max-length")]
)
def test_bad_settings_name_the_flag(tokenizer, tmp_path, overflow, max_length, flag):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD])
    with pytest.raises(DataError, match=flag):
        prepare_dataset(path, tokenizer, tmp_path / "shard", max_length, overflow)


def test_shard_round_trip(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", SAMPLES)
    shard = prepare_dataset(path, tokenizer, tmp_path / "shard", max_length=512)
    ds = TokenDataset(shard)

    expected = [tokenize_conversation(tokenizer, m) for m in load_chat_jsonl(path)]
    assert len(ds) == len(expected)
    for (ids, mask), (want_ids, want_mask) in zip((ds[i] for i in range(len(ds))), expected):
        assert ids.dtype == np.int64 and mask.dtype == np.bool_
        assert np.array_equal(ids, want_ids) and np.array_equal(mask, want_mask)
    assert ds.lengths.tolist() == [len(ids) for ids, _ in expected]
    assert np.array_equal(ds[-1][0], expected[-1][0])
    with pytest.raises(IndexError):
        ds[len(ds)]

    manifest = json.loads((shard / "manifest.json").read_text())
    assert manifest["num_samples"] == len(expected)
    assert manifest["num_tokens"] == sum(len(ids) for ids, _ in expected)
    assert (manifest["max_length"], manifest["overflow"]) == (512, "truncate")
    assert manifest["source"]["path"] == str(path.resolve())
    assert manifest["source"]["size"] == path.stat().st_size
    assert manifest["tokenizer"]["vocab_size"] == len(tokenizer)
    assert manifest["format_version"] == shards.FORMAT_VERSION
    assert np.load(shard / "offsets.npy").tolist() == [0, *np.cumsum(ds.lengths)[:-1].tolist()]


def _crash(*_args, **_kwargs):
    raise RuntimeError("simulated crash")


def test_manifest_reuse(tokenizer, tmp_path, monkeypatch, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", SAMPLES)
    shard = prepare_dataset(path, tokenizer, tmp_path / "shard", max_length=512)

    monkeypatch.setattr(prepare, "conversation_sequences", _crash)
    with caplog.at_level(logging.INFO, logger="dflash.data"):
        again = prepare_dataset(path, tokenizer, tmp_path / "shard", max_length=512)
    assert again == shard
    assert any("reusing" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("change", ["append", "touch", "max_length", "overflow", "template", "files"])
def test_manifest_invalidation(tokenizer, tmp_path, change):
    path = write_jsonl(tmp_path / "d.jsonl", SAMPLES)
    shard = prepare_dataset(path, tokenizer, tmp_path / "shard", max_length=512)
    settings = {"tokenizer": tokenizer, "max_length": 512, "overflow": "truncate"}
    expected_samples = len(SAMPLES)
    if change == "append":
        write_jsonl(path, SAMPLES + SAMPLES[:1])
        expected_samples += 1
    elif change == "touch":
        stat = path.stat()
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    elif change == "max_length":
        settings["max_length"] = 256
    elif change == "overflow":
        settings["overflow"] = "drop"
    elif change == "template":
        other = make_tiny_tokenizer()
        other.chat_template = other.chat_template.replace("<|im_end|>\\n'", "<|im_end|>\\n\\n'")
        assert other.chat_template != tokenizer.chat_template
        settings["tokenizer"] = other
    elif change == "files":
        (shard / "ids.bin").write_bytes(b"")
    marker = shard / "stale-marker"
    marker.touch()

    rebuilt = prepare_dataset(path, out_dir=shard, **settings)

    assert not marker.exists()
    ds = TokenDataset(rebuilt)
    assert len(ds) == expected_samples
    assert ds.manifest["max_length"] == settings["max_length"]
    assert ds.manifest["overflow"] == settings["overflow"]


def test_crash_leaves_no_valid_looking_shard(tokenizer, tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", SAMPLES)
    shard = tmp_path / "shard"

    monkeypatch.setattr(prepare, "write_index_and_manifest", _crash)
    with pytest.raises(RuntimeError):
        prepare_dataset(path, tokenizer, shard, max_length=512)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]
    with pytest.raises(DataError):
        TokenDataset(shard)


def test_crash_keeps_previous_shard(tokenizer, tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", SAMPLES)
    shard = prepare_dataset(path, tokenizer, tmp_path / "shard", max_length=512)
    monkeypatch.setattr(prepare, "write_index_and_manifest", _crash)

    with pytest.raises(RuntimeError):
        prepare_dataset(path, tokenizer, shard, max_length=256)
    assert len(TokenDataset(shard)) == len(SAMPLES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "shard"]


def test_refuses_to_replace_unrelated_directory(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", SAMPLES)
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="not a prepared-data directory"):
        prepare_dataset(path, tokenizer, out, max_length=512)
    assert (out / "notes.txt").read_text() == "keep me"


def test_dataset_rejects_missing_or_incompatible_shard(tokenizer, tmp_path):
    with pytest.raises(DataError, match="manifest"):
        TokenDataset(tmp_path)
    path = write_jsonl(tmp_path / "d.jsonl", SAMPLES)
    shard = prepare_dataset(path, tokenizer, tmp_path / "shard", max_length=512)
    manifest_path = shard / "manifest.json"
    manifest = json.loads(manifest_path.read_text())

    manifest_path.write_text(json.dumps({**manifest, "format_version": 999}))
    with pytest.raises(DataError, match="format version 999"):
        TokenDataset(shard)
    manifest_path.write_text(json.dumps({**manifest, "num_tokens": manifest["num_tokens"] + 1}))
    with pytest.raises(DataError, match="ids.bin"):
        TokenDataset(shard)


# ---------------------------------------------------------------------------
# Collation


def test_collate_pads_right_and_masks_padding(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", SAMPLES)
    ds = TokenDataset(prepare_dataset(path, tokenizer, tmp_path / "shard", max_length=512))
    indices = [2, 0]
    pad_id = tokenizer.pad_token_id
    batch = collate(ds, indices, pad_id)

    lengths = [len(ds[i][0]) for i in indices]
    width = max(lengths)
    assert batch["input_ids"].shape == batch["loss_mask"].shape == (2, width)
    assert batch["input_ids"].dtype == torch.long
    assert batch["loss_mask"].dtype == batch["attention_mask"].dtype == torch.bool
    assert batch["lengths"].tolist() == lengths and batch["lengths"].dtype == torch.long
    assert batch["sample_ids"].tolist() == indices and batch["sample_ids"].dtype == torch.long
    for row, i in enumerate(indices):
        ids, mask = ds[i]
        n = len(ids)
        assert batch["input_ids"][row, :n].tolist() == ids.tolist()
        assert batch["loss_mask"][row, :n].tolist() == mask.tolist()
        assert (batch["input_ids"][row, n:] == pad_id).all()
        assert not batch["loss_mask"][row, n:].any()
        assert batch["attention_mask"][row].tolist() == [True] * n + [False] * (width - n)


def test_prompt_ids_stop_at_the_generation_prompt():
    from dflash.data.tokenization import prompt_ids

    tok = make_tiny_tokenizer()
    messages = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi back"}]
    ids = prompt_ids(tok, messages)
    text = tok.decode(ids)
    assert text.endswith("<|im_start|>assistant\n") and "hi back" not in text
    full, mask = tokenize_conversation(tok, messages)
    assert list(full[: len(ids)]) == ids and not mask[: len(ids)].any() and mask[len(ids)]


def test_prompts_tokenized_in_one_batch_equal_those_tokenized_one_by_one():
    from dflash.data.tokenization import many_prompt_ids, prompt_ids

    tok = make_tiny_tokenizer()
    conversations = [[{"role": "user", "content": "hello there"}],
                     [{"role": "user", "content": "a longer question, with more words in it"},
                      {"role": "assistant", "content": "hi back"}, {"role": "user", "content": "and?"}],
                     [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}]]
    batched = many_prompt_ids(tok, conversations)
    assert batched == [prompt_ids(tok, m) for m in conversations]
    assert len({len(ids) for ids in batched}) == 3  # unpadded: each prompt keeps its own length
    assert many_prompt_ids(tok, []) == []


# ---------------------------------------------------------------------------
# Bad samples: skipped, counted and listed, within a bound


def test_bad_samples_are_skipped_counted_and_listed_with_file_and_line(tokenizer, tmp_path):
    good = [SAMPLES[i % 3] for i in range(197)]
    bad = ["{not json", json.dumps(chat(("user", "a"), ("robot", "b"))), '{"prompt": "a", "response": ""}']
    lines = good[:50] + [bad[0]] + good[50:120] + [bad[1]] + good[120:] + [bad[2]]
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    shard = prepare_dataset(path, tokenizer, tmp_path / "shard", max_length=64, max_bad_fraction=0.02)
    assert len(TokenDataset(shard)) == 197
    manifest = json.loads((shard / "manifest.json").read_text())
    assert manifest["stats"]["samples_bad"] == 3
    assert manifest["stats"]["bad_reasons"] == {"malformed JSON": 1, "unknown role": 1, "empty assistant turn": 1}
    report = (shard / shards.BAD_SAMPLES_FILE).read_text().splitlines()
    assert [line.split(": ", 2)[1] for line in report] == [f"{path}:51", f"{path}:122", f"{path}:200"]


def test_more_bad_samples_than_the_bound_stop_the_preparation(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [SAMPLES[0]] * 97 + ["{oops"] * 3)
    with pytest.raises(DataError, match=r"3 of 100 samples are bad \(3.0%, above --max-bad-fraction 0.01"):
        prepare_dataset(path, tokenizer, tmp_path / "shard", max_length=64)
    with pytest.raises(DataError, match=f"{path}:98: malformed JSON"):
        prepare_dataset(path, tokenizer, tmp_path / "shard", max_length=64, on_bad_sample="error")
    shard = prepare_dataset(path, tokenizer, tmp_path / "shard", max_length=64, max_bad_fraction=0.05)
    assert len(TokenDataset(shard)) == 97


def test_a_reply_whose_first_token_merges_with_the_prompt_is_located_by_characters():
    """Byte-level BPE merges the generation prompt's closing newline with a reply that opens
    with one, so the prompt is no TOKEN prefix of the turn; its text still is, and that
    locates the reply."""
    from dflash.demo import DEMO_TARGET_DIR

    demo = tokenization.load_tokenizer(DEMO_TARGET_DIR)
    messages = [{"role": "user", "content": "Continue this Python code:\nif x:"},
                {"role": "assistant", "content": "\n    return x + 1\n    pass"}]
    start = tokenization.prompt_ids(demo, messages[:1])
    turn = demo(tokenization._render_text(demo, messages, add_generation_prompt=False), add_special_tokens=False)["input_ids"]
    assert turn[:len(start)] != start  # the case a token-prefix rule must reject
    ids, mask = tokenize_conversation(demo, messages)
    reply = demo.decode(ids[mask])
    assert "return x + 1\n    pass" in reply and "Continue" not in reply and "assistant" not in reply


def test_overlong_content_is_cut_by_characters_without_changing_the_kept_tokens(tokenizer):
    messages = [{"role": "user", "content": "tell me"}, {"role": "assistant", "content": "the cat sat " * 5000}]
    full_ids, full_mask = tokenize_conversation(tokenizer, messages)
    ids, mask = tokenize_conversation(tokenizer, messages, max_chars=64 * tokenization.MAX_CHARS_PER_TOKEN)
    assert len(ids) < len(full_ids)
    assert np.array_equal(ids[:64], full_ids[:64]) and np.array_equal(mask[:64], full_mask[:64])


def test_a_nul_byte_in_a_line_is_a_malformed_sample(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(GOOD.encode() + b'\n{"prompt": "a\x00b", "response": "c"}\n')
    with pytest.raises(DataError, match=f"{path}:2: malformed JSON"):
        load_chat_jsonl(path)


@pytest.mark.parametrize("chunk_tokens", [1, 50, 1 << 26])
def test_anchor_candidate_counts_match_the_objective(tokenizer, tmp_path, chunk_tokens):
    """The per-sample counts the batch budget uses are the anchors the objective can draw,
    however the shard is read in chunks (samples never pair across their boundary)."""
    records = [chat(("user", "hi"), ("assistant", "a b c d e f")), chat(("user", "x"), ("assistant", "y")),
               chat(("user", "q"), ("assistant", "one two"), ("user", "more"), ("assistant", "three four five"))]
    ds = TokenDataset(prepare_dataset(write_jsonl(tmp_path / "d.jsonl", records), tokenizer, tmp_path / "s", 64))
    want = [int(anchor_candidates(torch.from_numpy(ds[i][1])[None]).sum()) for i in range(len(ds))]
    assert ds.anchor_candidates(chunk_tokens).tolist() == want
    assert min(want) >= 1


def test_parallel_preparation_writes_the_same_shard_and_names_bad_lines(tokenizer, tmp_path):
    records = [chat(("user", f"question {i}"), ("assistant", f"answer {i} " * (i % 7 + 1))) for i in range(300)]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    with path.open("a") as f:
        f.write("{broken\n")  # line 301: reported from a worker process with its file:line
    serial = TokenDataset(prepare_dataset(path, tokenizer, tmp_path / "one", 64, workers=1))
    parallel = TokenDataset(prepare_dataset(path, tokenizer, tmp_path / "two", 64, workers=2))
    assert len(serial) == len(parallel) == 300
    assert np.array_equal(serial.lengths, parallel.lengths)
    for i in range(300):
        assert np.array_equal(serial[i][0], parallel[i][0]) and np.array_equal(serial[i][1], parallel[i][1])
    assert f"{path}:301: malformed JSON" in (tmp_path / "two" / "bad_samples.txt").read_text()


def prepare_from_a_script(tokenizer, tmp_path: Path, samples: int, top: str, main: str):
    """Runs `top` + `if __name__ == '__main__':` `main` as a script (`base`: the tokenizer, `data`,
    `shard`: paths), as train_drafter.py starts a preparation; returns the finished process."""
    import subprocess
    import sys

    tokenizer.save_pretrained(tmp_path / "tok")
    data = write_jsonl(tmp_path / "d.jsonl", [chat(("user", f"q {i}"), ("assistant", f"a {i}")) for i in range(samples)])
    script = tmp_path / "launch.py"
    script.write_text(
        "from dflash.data.prepare import prepare_dataset\n"
        "from dflash.data.tokenization import load_tokenizer\n"
        f"base, data, shard = load_tokenizer({str(tmp_path / 'tok')!r}), {str(data)!r}, {str(tmp_path / 'shard')!r}\n"
        f"{top}\nif __name__ == '__main__':\n{main}\n")
    run = subprocess.run([sys.executable, str(script)], check=True, timeout=300, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert len(TokenDataset(tmp_path / "shard")) == samples
    return run


def test_preparation_workers_do_not_run_the_launching_script_again(tokenizer, tmp_path):
    """Started from a script (as train_drafter.py starts them), the pool's workers must not
    re-run it: multiprocessing would otherwise import the script's whole world in every worker,
    one worker after another (133 s on a 16-core host before the first sample)."""
    runs = tmp_path / "runs.txt"
    prepare_from_a_script(
        tokenizer, tmp_path, 50,
        f"import os\nopen({str(runs)!r}, 'a').write(f'{{os.getpid()}}\\n')  # once per process that runs this script",
        "    prepare_dataset(data, base, shard, 64, workers=3)\n"
        "    assert __file__  # given back to the script once the workers have started")
    assert len(runs.read_text().split()) == 1, "a preparation worker ran the launching script again"


def test_a_tokenizer_class_the_launching_script_defines_still_reaches_the_workers(tokenizer, tmp_path):
    """The exception to the above: workers that must unpickle a class defined in the script run
    it again (else each fails at its start with a traceback, and only the pool's restart of it,
    with the script visible again, recovers)."""
    run = prepare_from_a_script(
        tokenizer, tmp_path, 20, "class ScriptTokenizer(type(base)):\n    pass",
        "    base.__class__ = ScriptTokenizer\n    prepare_dataset(data, base, shard, 64, workers=2)")
    assert "Traceback" not in run.stderr, run.stderr


def test_data_tools_prepare_the_shard_the_run_reuses_and_report_stats(tmp_path, capsys):
    from dflash.tools.data import main as data_main

    out = tmp_path / "run"
    assert data_main(["stats", "--output-dir", str(out), "--target-length-groups", "4", "--draft-vocab", "64"]) == 0
    report = capsys.readouterr().out
    shipped = len(DEMO_TRAIN_DATA.read_text().splitlines())
    assert f"{shipped} samples read, {shipped} kept" in report and "of them trained on" in report
    assert "steps per epoch with 8 drafter rank(s)" in report
    shares = re.search(r"real tokens among a micro-batch.s padded ones: (\d+\.\d)%.*target computes in "
                       r"--target-length-groups 4: (\d+\.\d)%", report)
    assert shares and float(shares[1]) <= float(shares[2]) <= 100, report
    assert "trained tokens in repetition loops" in report
    held = re.search(r"--draft-vocab 64: chosen on 9 in 10 samples, it holds (\d+\.\d+)% of the 10th's reply tokens, "
                     r"(\d+\.\d+)% of each reply's first 128", report)
    assert held and 0 < float(held[1]) < 100 and 0 < float(held[2]) < 100, report
    manifest = (out / "data" / "train" / "manifest.json").read_text()
    assert data_main(["prepare", "--output-dir", str(out)]) == 0  # same flags: reused as is
    assert "reusing prepared data" in capsys.readouterr().err
    assert (out / "data" / "train" / "manifest.json").read_text() == manifest
    assert data_main(["stats", "--output-dir", str(out), "--max-length", "0"]) == 2
    assert data_main(["frobnicate"]) == 2


def test_a_folder_without_tokenizer_files_is_named_as_such(tmp_path):
    """Not blamed on the chat template: the folder has no tokenizer at all."""
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(DataError, match="holds no tokenizer files"):
        load_tokenizer(tmp_path)


def test_repetition_loops_are_counted_over_trained_tokens_only():
    """A trained token is in a loop when the 8-gram it ends occurred earlier among its sample's
    trained tokens; the prompt never counts, and the opening share looks at the first tokens only."""
    import numpy as np

    from dflash.tools.data import repeated_ngram_share

    prompt = list(range(10, 20))  # the same tokens as the reply's cycle: must not count
    cycle = list(range(10, 20))
    ids = np.array(prompt + cycle * 3 + [7])
    mask = np.zeros(len(ids), dtype=bool)
    mask[len(prompt):] = True
    # 31 trained tokens, 24 windows of 8; window i repeats window i - 10 for i = 10..22: 13 loops
    assert repeated_ngram_share([(ids, mask)]) == (13 / 31, 13 / 31)
    assert repeated_ngram_share([(ids, mask)], opening=20) == (13 / 31, 3 / 20)  # windows 10..12 end by token 19
    fresh = np.arange(100, 140)
    both = repeated_ngram_share([(ids, mask), (fresh, np.ones(40, dtype=bool))])
    assert both[0] == 13 / 71
    assert repeated_ngram_share([(np.arange(5), np.ones(5, dtype=bool))]) == (0.0, 0.0)  # shorter than a window


def test_draft_vocab_shares_are_measured_on_replies_the_vocabulary_was_not_chosen_on():
    from dflash.tools.data import draft_vocab_shares

    def sample(reply):
        ids = np.array([7, 7, *reply])  # two prompt tokens, never trained on
        return ids, np.array([False, False] + [True] * len(reply))

    # Every 3rd sample (the 3rd, the 6th) is measured; the others count 1 five times, 2 four, 3 to 5 once.
    samples = [sample([1, 1, 2, 3]), sample([1, 2, 4]), sample([1, 9, 9, 2, 1]),
               sample([2, 1, 5]), sample([1, 2]), sample([9, 1, 1, 1])]
    assert draft_vocab_shares(samples, vocab_size=12, size=2, fold=3) == (6 / 9, 6 / 9)  # {1, 2}
    assert draft_vocab_shares(samples, vocab_size=12, size=2, fold=3, opening=2) == (6 / 9, 2 / 4)
    # The end-of-turn token is always in it, as training chooses it: {9, 1}.
    assert draft_vocab_shares(samples, vocab_size=12, size=2, always=[9], fold=3) == (8 / 9, 8 / 9)
