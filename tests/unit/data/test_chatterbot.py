"""Tests for dflash.data.chatterbot: a ChatterBot corpus file -> coding prompts."""

from __future__ import annotations

import json

from dflash.data.chatterbot import main

CORPUS = """categories:
- coding
conversations:
- - can you write a sorting algorithm?
  - |
    Sure. Here's quicksort in Python.
- - can you write a sorting algorithm?
  - Here's merge sort.
- - Can you write a sorting algorithm
  - Again, said another way.
- - can you add authentication to a Flask API?
  - Use flask-login.
- - can you write a closure in JavaScript?
  - Sure.
- - can you explain what a mutex is, with no reply given?
- 42
"""


def test_first_turns_become_prompts_and_repeats_or_held_out_ones_are_counted(tmp_path, capfd):
    source = tmp_path / "coding.yml"
    source.write_text(CORPUS)
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(json.dumps({"messages": [{"role": "user", "content": "Can you add authentication to my "
                                                 "Flask API?"}]}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["--out", str(out), "--source", str(source), "--heldout", str(heldout)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["chatterbot:0", "chatterbot:1", "chatterbot:2"]
    assert [r["messages"] for r in records] == [[{"role": "user", "content": text}] for text in (
        "can you write a sorting algorithm?", "can you write a closure in JavaScript?",
        "can you explain what a mutex is, with no reply given?")]
    assert "dropped 2 repeating an earlier turn, 1 repeating a --heldout turn" in capfd.readouterr().err


def test_a_file_that_is_no_corpus_gets_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yml"
    bad.write_text("just: [a, mapping]\n")
    assert main(["--out", str(tmp_path / "o.jsonl"), "--source", str(bad)]) == 2
    assert "no `conversations:` list" in capsys.readouterr().err
