"""The demo answers' quality measure: loops score low, varied text high; the shipped answers pass."""

from __future__ import annotations

import json
import sys

import pytest

from transformers import AutoTokenizer

from dflash.demo import DEMO_HELDOUT_DATA, DEMO_TARGET_DIR, DEMO_TRAIN_DATA
from dflash.demo.build_target import BUILD_REPORT
from dflash.demo.quality import (answer_quality, distinct_bigram_ratio, generalises, heldout_loss_ratio,
                                 repeats_a_line)

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
    varied = [f"width_{i} = {i}\n{VARIED}" for i in range(9)]  # distinct openings, as distinct prompts give
    good = answer_quality(varied + [LOOP], tokenizer)
    bad = answer_quality([LOOP] * 5 + varied[:5], tokenizer)
    same_opening = answer_quality([VARIED] * 9 + [LOOP], tokenizer)
    assert good["median_distinct_bigram_ratio"] > 0.6 and good["repeating_line_share"] == 0.1
    assert good["good_enough"]
    assert bad["repeating_line_share"] == 0.5 and not bad["good_enough"]
    assert same_opening["distinct_opening_share"] == 0.1 and not same_opening["good_enough"]


@pytest.mark.parametrize("data", [DEMO_TRAIN_DATA, DEMO_HELDOUT_DATA], ids=["train", "heldout"])
def test_the_shipped_demo_answers_are_varied_and_follow_their_prompts(data):
    """The committed demo answers pass the quality bars: varied text, few loops, and answers to
    different prompts that open differently (a target answering from its weights fails that)."""
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET_DIR)
    answers = [json.loads(line)["messages"][-1]["content"] for line in data.read_text().splitlines()]
    quality = answer_quality(answers, tokenizer)
    assert quality["good_enough"], quality


def test_the_shipped_demo_target_does_as_well_on_conversations_it_never_saw():
    report = json.loads((DEMO_TARGET_DIR / BUILD_REPORT).read_text())
    assert generalises(report), report


def test_a_target_that_memorised_its_conversations_does_not_pass_for_one_that_generalises():
    assert generalises({"train_loss": 2.0, "heldout_loss": 2.5})  # ratio 1.25
    assert generalises({"train_loss": 0.03, "heldout_loss": 0.07})  # near zero: a gap of 0.04 nats
    assert not generalises({"train_loss": 0.06, "heldout_loss": 1.9})  # memorised
    assert not generalises({"train_loss": 2.0, "heldout_loss": 2.8})


def test_answers_that_share_their_opening_do_not_count_as_prompt_dependent():
    from dflash.demo.quality import OPENING_TOKENS, distinct_opening_share

    same_start = [1] * OPENING_TOKENS
    assert distinct_opening_share([same_start + [2], same_start + [3], [4, 5], [6]]) == 0.5
    assert distinct_opening_share([[1], [2], [3]]) == 1.0


def test_a_target_built_from_chats_loads_and_reports_its_held_out_loss(tmp_path, monkeypatch):
    """python -m dflash.demo.build_target --chats: a loadable tiny Qwen3 with its own tokenizer,
    trained one pass, and build_report.json with losses below the uniform guess's."""
    import math

    from transformers import AutoModelForCausalLM

    from dflash.demo import build_target
    from dflash.demo.chat_corpus import HELDOUT_MODULUS

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(DEMO_TRAIN_DATA.read_text().splitlines(keepends=True)[:8 * HELDOUT_MODULUS]))
    out = tmp_path / "target"
    monkeypatch.setattr(sys, "argv", ["build_target", "--chats", str(chats), "--output-dir", str(out),
                                      "--hidden-size", "64", "--layers", "2", "--intermediate-size", "128",
                                      "--vocab-size", "512", "--batch-size", "16", "--max-length", "512",
                                      "--warmup-steps", "4", "--epochs", "4"])
    build_target.main()
    report = json.loads((out / build_target.BUILD_REPORT).read_text())
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    assert AutoTokenizer.from_pretrained(out).chat_template
    uniform = math.log(model.config.vocab_size)
    assert report["train_loss"] < 0.8 * uniform and report["heldout_loss"] < 0.8 * uniform, report
    assert 0.5 < heldout_loss_ratio(report) < 2, report


@pytest.mark.parametrize("flags, message", [
    (["--chats", "c.jsonl", "--hidden-size", "32"], "--hidden-size 32: use a multiple of 64"),
])
def test_flags_build_target_cannot_honour_are_refused(monkeypatch, flags, message):
    from dflash.demo import build_target

    monkeypatch.setattr(sys, "argv", ["build_target", *flags])
    with pytest.raises(SystemExit, match=message):
        build_target.main()
