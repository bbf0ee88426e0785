"""The demo target's text-editing chats: answers made from the passage, a split that matches the
target build's, and prompts that hold no answer."""

from __future__ import annotations

import json

import pytest

from dflash.demo.chat_corpus import is_heldout
from dflash.demo.edit_tasks import TASKS, edit_chat, main, passages, sentences

PROSE = "Tides rise twice a day, every day. The moon pulls the sea! Why does it? Gravity, mostly."


def test_every_task_answers_from_the_passage():
    answers = {instruction: answer(PROSE) for instruction, answer in TASKS}
    assert sentences(PROSE) == ["Tides rise twice a day, every day.", "The moon pulls the sea!", "Why does it?", "Gravity, mostly."]
    assert answers["Repeat the following text word for word."] == PROSE
    assert answers["Split the following text into sentences, one per line, numbered."].splitlines()[2] == "3. Why does it?"
    assert answers["What is the last sentence of the following text?"] == 'The last sentence is: "Gravity, mostly."'
    assert json.loads(answers['Put the following text in a JSON object under the key "text".']) == {"text": PROSE}
    for answer in answers.values():  # each answer is built from the passage's own sentences
        assert "Tides rise twice a day, every day." in answer or "Gravity, mostly." in answer


def test_passages_are_prose_paragraphs_of_the_right_length():
    code = "```python\n" + "x = 1\n" * 20 + "```"
    messages = [{"role": "user", "content": f"short\n\n{PROSE}\n\n- a bullet that is long enough to count if it were prose"},
                {"role": "assistant", "content": f"{code}\n\n{'word ' * 100}"}]
    assert list(passages(messages)) == [PROSE]


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_the_split_is_the_target_builds_and_prompts_carry_no_answer(tmp_path, split):
    source, out = tmp_path / "source.jsonl", tmp_path / "out.jsonl"
    texts = [f"Paragraph number {i} says something about topic {i * 7}, at some length. It ends right here." for i in range(400)]
    source.write_text("".join(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n" for t in texts))
    assert main(["--source", str(source), "--output", str(out), "--split", split, "--prompts-only"]) == 0
    written = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    expected = [edit_chat(t, 0)["messages"] for t in texts]
    expected = [m for m in expected if is_heldout(m) == (split == "heldout")]
    assert 0 < len(written) == len(expected) < 400
    assert written == [m[:1] for m in expected]


def test_a_source_without_prose_is_refused(tmp_path, capsys):
    source = tmp_path / "source.jsonl"
    source.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert main(["--source", str(source), "--output", str(tmp_path / "out.jsonl")]) == 2
    assert f"--source {source}: no prose paragraph" in capsys.readouterr().err
