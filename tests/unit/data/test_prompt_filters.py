"""Tests for dflash.data.prompt_filters: mostly-ASCII text, code requests, exact and near-duplicates."""

from __future__ import annotations

import json
import random

import pytest

from dflash.data.prompt_filters import (
    BUCKET_CAP, Fingerprint, NearDuplicates, looks_like_code, mostly_ascii, normalise, user_turns)

CODE_REQUESTS = [
    "How do I reverse a list in Python?",
    "Write a function that returns the longest common prefix of an array of strings.",
    "Why does this fail?\n```\nx = [1, 2\n```",
    "Fix my query: SELECT name FROM users WHERE age > 30 GROUP BY city",
    "def add(a, b):\n    return a - b\nwhat's wrong here",
    "Explain the difference between a process and a thread when debugging a server.",
    "Can you help me set up Docker for my app?",
    "What does the => arrow mean in this snippet?",
]
PROSE = [
    "What is the capital of France?",
    "Write a poem about the sea at night.",
    "I have a class at school tomorrow and I feel nervous, any tips?",
    "Select the best title from these three for my essay on climate.",
    "Tell me about giant pandas and what they eat.",
    "Import duties on coffee: how do they work in the EU?",
    "Plan a three-day trip to Rome for a family of four.",
    "How did people react to the first moon landing?",
]


def test_mostly_ascii_is_at_least_80_percent_ascii():
    assert mostly_ascii("Hello, how are you today?")
    assert mostly_ascii("Café au lait, s'il vous plaît, merci")  # 3 of 36 characters
    assert not mostly_ascii("Привет, как у тебя дела сегодня?")
    assert not mostly_ascii("请用中文解释一下 Python 的装饰器")


@pytest.mark.parametrize("text", CODE_REQUESTS)
def test_code_requests_look_like_code(text):
    assert looks_like_code(text)


@pytest.mark.parametrize("text", PROSE)
def test_prose_does_not_look_like_code(text):
    assert not looks_like_code(text)


def test_prompts_that_differ_in_case_punctuation_and_spacing_are_exact_duplicates():
    index = NearDuplicates(0.6)
    first = index.add(Fingerprint.of("How do I sort a list in Python?"))
    assert normalise("  how do I   SORT a list, in python!! ") == "how do i sort a list in python"
    match = index.match(Fingerprint.of("  how do I   SORT a list, in python!! "))
    assert match is not None and match.index == first and match.exact


def test_near_duplicates_are_found_and_prompts_that_share_a_frame_are_not():
    index = NearDuplicates(0.6)
    base = ("Write a Python function that takes a list of integers and returns a new list with only the even "
            "numbers, keeping their order.")
    other = index.add(Fingerprint.of("Write a Python function to check if a string is a palindrome."))
    kept = index.add(Fingerprint.of(base))
    for variant in (base.replace("integers", "numbers"), base.replace("a new list", "another list"),
                    base.replace(", keeping their order.", " and keeps the order.")):
        match = index.match(Fingerprint.of(variant))
        assert match is not None and match.index == kept and not match.exact, variant
    for distinct in ("Write a Python function to check if a number is prime.",
                     "Write a Python function that takes a list of strings and returns them sorted by length."):
        assert index.match(Fingerprint.of(distinct)) is None, distinct
    assert index.match(Fingerprint.of("Write a Python function to check if a string is a palindrome")).index == other


def test_thousands_of_distinct_prompts_are_kept_and_buckets_stay_bounded():
    """No false matches among 5,000 prompts of random words, and a family of near-identical
    prompts fills no LSH bucket past BUCKET_CAP (a check stays O(1))."""
    rng = random.Random(0)
    words = [f"word{i}" for i in range(300)]
    index = NearDuplicates(0.6)
    for _ in range(5000):
        fingerprint = Fingerprint.of(" ".join(rng.choices(words, k=12)))
        assert index.match(fingerprint) is None
        index.add(fingerprint)
    family = Fingerprint.of("the same request, asked again and again")
    for _ in range(3 * BUCKET_CAP):
        index.add(family)
    assert len(index) == 5000 + 3 * BUCKET_CAP
    assert max(len(members) for bucket in index._buckets for members in bucket.values()) == BUCKET_CAP
    assert index.match(family).exact


def test_the_threshold_is_checked():
    with pytest.raises(ValueError, match="threshold 1.5"):
        NearDuplicates(1.5)


def test_user_turns_are_every_user_message_of_the_files(tmp_path):
    path = tmp_path / "heldout.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"role": "user", "content": "first"}, {"role": "assistant", "content": "a"},
                      {"role": "user", "content": "second"}]},
        {"prompt": "third"}]) + "\n")
    assert user_turns([str(path)]) == ["first", "second", "third"]
