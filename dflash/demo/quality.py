"""How plausible the demo target's answers are: a drafter learns little from degenerate text.

    python -m dflash.demo.quality                       # the shipped demo data
    python -m dflash.demo.quality runs/x/train.jsonl --json

For each assistant answer: the distinct-bigram ratio over the target tokenizer's tokens
(distinct adjacent pairs / all pairs; a loop that repeats itself scores low) and whether one
non-blank line occurs three or more times. The demo target is good enough when the median ratio
is at least MIN_DISTINCT_BIGRAMS and at most MAX_REPEATING_SHARE of the answers repeat a line.

Whether answers depend on their prompt: the share of answers whose first OPENING_TOKENS tokens no
other answer shares (a target that answers from its weights gives many prompts one opening), and
the target's held-out loss against its training loss (build_report.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path

from transformers import AutoTokenizer

from dflash.demo import DEMO_TARGET_DIR, DEMO_TRAIN_DATA

MIN_DISTINCT_BIGRAMS = 0.6
MAX_REPEATING_SHARE = 0.10
REPEATS = 3  # occurrences of one line that count as a loop
OPENING_TOKENS = 16
MIN_DISTINCT_OPENINGS = 0.9
MAX_HELDOUT_LOSS_RATIO = 1.3
# Near zero the ratio of two losses says little (the demo target's 0.044 against 0.027 nats per
# token is 1.6x, a gap of 0.017): there the held-out loss may exceed the training loss by this
# much instead.
MAX_HELDOUT_LOSS_GAP = 0.05


def distinct_bigram_ratio(ids: list[int]) -> float:
    pairs = list(zip(ids, ids[1:]))
    return len(set(pairs)) / len(pairs) if pairs else 1.0


def repeats_a_line(text: str) -> bool:
    counts = Counter(line.strip() for line in text.splitlines() if line.strip())
    return bool(counts) and max(counts.values()) >= REPEATS


def distinct_opening_share(answers: list[list[int]]) -> float:
    """Share of answers (token ids) whose first OPENING_TOKENS tokens are theirs alone."""
    openings = Counter(tuple(ids[:OPENING_TOKENS]) for ids in answers)
    return sum(openings[tuple(ids[:OPENING_TOKENS])] == 1 for ids in answers) / max(len(answers), 1)


def heldout_loss_ratio(build_report: dict) -> float:
    """The target's loss on held-out conversations over its loss on training ones."""
    return build_report["heldout_loss"] / build_report["train_loss"]


def generalises(build_report: dict) -> bool:
    """The target does about as well on conversations it never saw as on those it trained on."""
    return (heldout_loss_ratio(build_report) <= MAX_HELDOUT_LOSS_RATIO
            or build_report["heldout_loss"] - build_report["train_loss"] <= MAX_HELDOUT_LOSS_GAP)


def answer_quality(answers: list[str], tokenizer) -> dict:
    encoded = [tokenizer.encode(a, add_special_tokens=False) for a in answers]
    ratios = [distinct_bigram_ratio(ids) for ids in encoded]
    repeating = sum(repeats_a_line(a) for a in answers) / len(answers)
    openings = distinct_opening_share(encoded)
    return {
        "answers": len(answers),
        "median_distinct_bigram_ratio": round(statistics.median(ratios), 3),
        "repeating_line_share": round(repeating, 3),
        "distinct_opening_share": round(openings, 3),
        "good_enough": (statistics.median(ratios) >= MIN_DISTINCT_BIGRAMS and repeating <= MAX_REPEATING_SHARE
                        and openings >= MIN_DISTINCT_OPENINGS),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", nargs="?", type=Path, default=DEMO_TRAIN_DATA, help="chat JSONL answered by the target")
    parser.add_argument("--tokenizer", default=str(DEMO_TARGET_DIR))
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    answers = [json.loads(line)["messages"][-1]["content"] for line in args.data.read_text().splitlines()]
    quality = answer_quality(answers, AutoTokenizer.from_pretrained(args.tokenizer))
    if args.json:
        print(json.dumps(quality))
    else:
        print(f"{quality['answers']} answers: median distinct-bigram ratio {quality['median_distinct_bigram_ratio']} "
              f"(want >= {MIN_DISTINCT_BIGRAMS}), a line repeated {REPEATS}+ times in "
              f"{quality['repeating_line_share']:.0%} (want <= {MAX_REPEATING_SHARE:.0%}), a first "
              f"{OPENING_TOKENS} tokens of their own in {quality['distinct_opening_share']:.0%} "
              f"(want >= {MIN_DISTINCT_OPENINGS:.0%})")


if __name__ == "__main__":
    main()
