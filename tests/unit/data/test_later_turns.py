"""Tests for dflash.data.later_turns: ShareGPT's later human turns asked alone."""

from __future__ import annotations

import json

from dflash.data.later_turns import main

LONG = "Could you explain how Python's garbage collector handles reference cycles?"


def prompt(pid: str, *turns: str) -> dict:
    roles = ["user", "assistant"] * len(turns)
    return {"id": pid, "messages": [{"role": r, "content": t} for r, t in zip(roles, turns)]}


def test_later_turns_are_asked_alone_and_short_repeated_or_held_out_ones_are_counted(tmp_path, capfd):
    first = "Write a haiku about the sea, please, with a twist at the end of it."
    train = [
        prompt("a:0", first),
        prompt("a:2", first, "Waves fold...", LONG),  # kept, alone
        prompt("b:2", "Hi there, how are you doing today?", "Fine.", "now in Python"),  # short
        prompt("c:2", "Tell me something.", "Sure.", first.upper()),  # repeats a first turn
        prompt("d:2", "Tell me more things.", "Sure.", LONG + " "),  # repeats an earlier kept turn
        prompt("e:2", "Another opener here.", "Ok.", "What is the capital of France, and why was it chosen?"),
        prompt("f:4", "x" * 30, "y", "z" * 30, "w", "Summarise the whole discussion above in three bullet points."),
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in train))
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(json.dumps(prompt("h:0", "What is the capital of France and why was it chosen?")) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["--train", str(tmp_path / "train.jsonl"), "--out", str(out), "--heldout", str(heldout)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records == [
        {"id": "a:2:alone", "messages": [{"role": "user", "content": LONG}]},
        {"id": "f:4:alone", "messages": [{"role": "user", "content":
                                         "Summarise the whole discussion above in three bullet points."}]},
    ]
    assert ("dropped 1 shorter than --min-chars, 2 repeating a first turn or an earlier turn, "
            "1 repeating a --heldout turn") in capfd.readouterr().err


def test_a_line_that_is_no_prompt_is_named_with_its_line(tmp_path, capsys):
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps(prompt("a:0", "Hello there, this is a fine first turn.")) + "\n"
                     + json.dumps({"id": "b", "messages": [{"role": "user", "content": "q"},
                                                           {"role": "assistant", "content": "a"}]}) + "\n")
    assert main(["--train", str(train), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert f"{train}:2: not a prompt line" in capsys.readouterr().err


def sharegpt_source(tmp_path):
    """5 conversations of two human turns each (their later turn long enough to be asked alone)."""
    turns = ["Tell me about the history of the Roman empire in brief", "It rose and fell.",
             "Which emperor built the longest wall across northern Britain, and why?", "Hadrian."]
    source = tmp_path / "sharegpt.json"
    source.write_text(json.dumps([
        {"id": f"c{i}", "conversations": [{"from": "human" if j % 2 == 0 else "gpt", "value": f"{t} ({i})"}
                                          for j, t in enumerate(turns)]} for i in range(5)]))
    return source


def test_dflash_data_prompts_takes_the_later_turns_by_default_and_leaves_them_out_when_told(tmp_path, capfd):
    from dflash.data.prompts import PromptsArgs, main as prompts_main
    source = sharegpt_source(tmp_path)
    assert "sharegpt-later" in PromptsArgs(out_dir="x", n=1).sources
    base = ["--sharegpt-source", str(source), "--heldout", "1", "--sources", "sharegpt"]
    assert prompts_main(["--out-dir", str(tmp_path / "plain"), *base, "--n", "9"]) == 2
    assert "leave 1 prompt missing" in capfd.readouterr().err  # 4 conversations x 2 turns
    out = tmp_path / "later"
    assert prompts_main(["--out-dir", str(out), *base, "sharegpt-later", "--n", "12"]) == 0
    summary = json.loads((out / "prompts.json").read_text())
    assert summary["available"] == {"sharegpt": 8, "sharegpt-later": 4}
    alone = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()
             if json.loads(line)["source"] == "sharegpt-later"]
    assert sorted(r["id"] for r in alone) == [f"c{i}:2:alone" for i in range(5) if f"c{i}" != held_out(out)]
    assert all(len(r["messages"]) == 1 and r["messages"][0]["content"].startswith("Which emperor") for r in alone)


def held_out(out) -> str:
    (line,) = (out / "heldout.jsonl").read_text().splitlines()
    return json.loads(line)["id"].split(":")[0]


def test_n_0_takes_every_registry_prompt_and_refuses_a_code_share(tmp_path, capfd):
    from dflash.data.prompts import main as prompts_main
    base = ["--sharegpt-source", str(sharegpt_source(tmp_path)), "--heldout", "1", "--n", "0"]
    out = tmp_path / "all"
    assert prompts_main(["--out-dir", str(out), *base, "--sources", "sharegpt", "sharegpt-later"]) == 0
    summary = json.loads((out / "prompts.json").read_text())
    assert summary["written"] == 12 and summary["taken"]["magpie"]["prompts"] == 0
    assert len((out / "prompts.jsonl").read_text().splitlines()) == 12
    capfd.readouterr()
    assert prompts_main(["--out-dir", str(out), *base, "--code-share", "0.5"]) == 2
    assert "--n 0 takes every registry prompt as it comes: drop --code-share" in capfd.readouterr().err
    assert prompts_main(["--out-dir", str(tmp_path / "none"), *base, "--sources", "none"]) == 2
    assert "hold none" in capfd.readouterr().err
