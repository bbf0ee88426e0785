"""The demo answers' quality measure: loops score low, varied text high; the shipped answers pass."""

from __future__ import annotations

import json
import sys

from transformers import AutoTokenizer

from dflash.demo import DEMO_TARGET_DIR, DEMO_TRAIN_DATA
from dflash.demo.quality import REFERENCE_SAMPLES, answer_quality, distinct_bigram_ratio, main, repeats_a_line

VARIED = "def area(r):\n    return 3.14 * r * r\n\nclass Box:\n    def __init__(self, w, h):\n        self.w = w\n"
LOOP = "x = 1\n" * 6


def test_distinct_bigram_ratio():
    assert distinct_bigram_ratio([1, 2, 3, 4, 5]) == 1.0
    assert distinct_bigram_ratio([1, 2] * 10) == 2 / 19
    assert distinct_bigram_ratio([7]) == 1.0


def test_a_line_repeated_three_times_is_a_loop():
    assert repeats_a_line(LOOP)
    assert not repeats_a_line(VARIED)
    assert not repeats_a_line("a = 1\n\n\n\nb = 2\n")  # blank lines do not count
    assert repeats_a_line("    pass\n  pass\npass\n")  # indentation does not hide a repeat


def test_answer_quality_separates_varied_code_from_loops():
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET_DIR)
    good = answer_quality([VARIED] * 9 + [LOOP], tokenizer)
    bad = answer_quality([LOOP] * 5 + [VARIED] * 5, tokenizer)
    assert good["median_distinct_bigram_ratio"] > 0.6 and good["repeating_line_share"] == 0.1
    assert good["good_enough"]
    assert bad["repeating_line_share"] == 0.5 and not bad["good_enough"]


def test_the_shipped_demo_answers_are_plausible_code():
    """The committed demo data passes the bar it was rebuilt for (the previous target's did not)."""
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET_DIR)
    answers = [json.loads(line)["messages"][-1]["content"] for line in DEMO_TRAIN_DATA.read_text().splitlines()]
    assert answer_quality(answers, tokenizer)["good_enough"]


def test_reference_mode_measures_real_code(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["quality", "--reference", "heldout", "--json"])
    main()
    figures = json.loads(capsys.readouterr().out)
    assert figures["answers"] == REFERENCE_SAMPLES and figures["median_distinct_bigram_ratio"] > 0.6
