"""ChatterBot's English coding requests -> prompt-only chat JSONL: short coding prompts from the
chatterbot-corpus package (BSD; its `english/coding.yml` holds 96 distinct requests such as "can
you add authentication to a Flask API?"; `pip install --no-deps chatterbot-corpus`: only the file
is read, nothing of it is imported).

    python -m dflash.data.chatterbot --out runs/real/data/chatterbot_prompts.jsonl \\
        [--source FILE] [--heldout runs/real/data/heldout.jsonl]

The first turn of each conversation in the file makes one prompt, {"id": "chatterbot:<n>",
"messages": [{"role": "user", "content": ...}]}, in the file's order. A turn is dropped, and
counted, when it repeats an earlier one (after normalising case, punctuation and spacing), or a
user turn of a --heldout file (exactly or as a near-duplicate, as in dflash.data.leetcode). The
corpus's other files are small talk (greetings, food, gossip; tech_support.yml repeats 10 distinct
turns), which teaches a coder target's drafter little, so only coding.yml is read by default.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dflash.data.chat_formats import DataError
from dflash.data.prompt_filters import Fingerprint, heldout_index
from dflash.util.cli import cli_parser, user_error
from dflash.util.files import output_file_problem, write_text_durably
from dflash.util.runtime import setup_logging

logger = logging.getLogger(__name__)

SOURCE_PACKAGE = "chatterbot_corpus"
SOURCE_FILE = "data/english/coding.yml"
REPEATED, HELDOUT = "repeating an earlier turn", "repeating a --heldout turn"


@dataclass
class ChatterBotArgs:
    out: str = field(metadata={"help": "chat JSONL to write (prompt-only: --prompts of dflash.regenerate)"})
    source: str | None = field(default=None, metadata={
        "help": "a ChatterBot corpus YAML file (default: the chatterbot-corpus package's english/coding.yml)"})
    heldout: list[str] = field(default_factory=list, metadata={
        "help": "chat JSONL files whose user turns no prompt may repeat"})
    near_dup: float = field(default=0.6, metadata={
        "help": "a turn this similar to a held-out turn (character 5-gram Jaccard) is dropped"})


def default_source() -> Path:
    """english/coding.yml inside the installed chatterbot-corpus package."""
    spec = importlib.util.find_spec(SOURCE_PACKAGE)
    if spec is None or spec.origin is None:
        raise DataError("the chatterbot-corpus package is not installed: run `pip install --no-deps "
                        "chatterbot-corpus` or pass --source with a corpus YAML file")
    return Path(spec.origin).parent / SOURCE_FILE


def first_turns(path: Path) -> list[str]:
    """The first turn of each conversation of a corpus file ({"conversations": [[turn, reply, ...]]})."""
    try:
        corpus = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise DataError(f"--source {path}: cannot read it as a ChatterBot corpus ({err}); pass a corpus YAML file")
    conversations = corpus.get("conversations") if isinstance(corpus, dict) else None
    if not isinstance(conversations, list):
        raise DataError(f"--source {path}: no `conversations:` list; pass a ChatterBot corpus YAML file")
    return [c[0].strip() for c in conversations if isinstance(c, list) and c and isinstance(c[0], str) and c[0].strip()]


def build_prompts(args: ChatterBotArgs) -> tuple[int, Counter]:
    """Write --out; return (prompts written, turns dropped by reason)."""
    heldout = heldout_index(args.heldout, args.near_dup)
    problem = output_file_problem(Path(args.out))
    if problem:
        raise DataError(f"--out {args.out}: {problem}; pass a file path you can write to")
    seen, kept, dropped = set(), [], Counter()
    for turn in first_turns(Path(args.source) if args.source else default_source()):
        fingerprint = Fingerprint.of(turn)
        reason = HELDOUT if heldout.match(fingerprint) is not None else REPEATED if fingerprint.digest in seen else None
        if reason:
            dropped[reason] += 1
            continue
        seen.add(fingerprint.digest)
        kept.append(json.dumps({"id": f"chatterbot:{len(kept)}", "messages": [{"role": "user", "content": turn}]}))
    write_text_durably(Path(args.out), "".join(line + "\n" for line in kept))
    return len(kept), dropped


def main(argv: list[str] | None = None) -> int:
    (args,) = cli_parser(ChatterBotArgs).parse_args_into_dataclasses(argv)
    setup_logging(0)
    try:
        written, dropped = build_prompts(args)
    except DataError as err:
        return user_error(err)
    logger.info("dropped %d %s, %d %s; %s: %d prompts", dropped[REPEATED], REPEATED, dropped[HELDOUT], HELDOUT,
                args.out, written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
