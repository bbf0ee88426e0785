"""ShareGPT's later human turns asked alone -> prompt-only chat JSONL: more first-turn prompts,
written by people, from conversations already on the train side.

    python -m dflash.data.later_turns --train runs/real/data/train_prompts.jsonl \\
        --out runs/real/data/sharegpt-later_prompts.jsonl [--heldout runs/real/data/heldout.jsonl] [--min-chars 50]

dflash.data.sharegpt makes one prompt per human turn, a later turn with its conversation before
it. Held-out prompts are first turns, and a later turn with context costs the target about five
times the prompt tokens of a first turn. Here every later turn (a prompt of --train with more than
its own message) of at least --min-chars characters is also asked with no context,
{"id": "<conversation>:<turn>:alone", "messages": [{"role": "user", "content": turn}]}: the target
answers it as it would any first turn (a turn that leans on its context gets a reply asking for
it, which is still the target's own writing). A turn is dropped, and counted, when it repeats
(after normalising case, punctuation and spacing) a first turn of --train or an earlier kept one,
or repeats a user turn of a --heldout file exactly or as a near-duplicate (as in
dflash.data.leetcode). --train holds no held-out conversation (dflash.data.sharegpt's split), so
this adds none either.
"""

from __future__ import annotations

import json
import logging
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from dflash.data.chat_formats import DataError, iter_lines, parse_line
from dflash.data.prompt_filters import Fingerprint, heldout_index
from dflash.data.sharegpt import MIN_ALONE_CHARS
from dflash.util.cli import cli_parser, user_error
from dflash.util.files import output_file_problem, write_text_durably
from dflash.util.runtime import setup_logging

logger = logging.getLogger(__name__)

SHORT, REPEATED, HELDOUT = "shorter than --min-chars", "repeating a first turn or an earlier turn", \
    "repeating a --heldout turn"


@dataclass
class LaterTurnsArgs:
    train: str = field(metadata={"help": "dflash.data.sharegpt's train_prompts.jsonl"})
    out: str = field(metadata={"help": "chat JSONL to write (prompt-only: --prompts of dflash.regenerate)"})
    heldout: list[str] = field(default_factory=list, metadata={
        "help": "chat JSONL files whose user turns no prompt may repeat"})
    min_chars: int = field(default=MIN_ALONE_CHARS, metadata={
        "help": "shortest turn asked alone, in characters (shorter ones lean on their context: 'now in Python')"})
    near_dup: float = field(default=0.6, metadata={
        "help": "a turn this similar to a held-out turn (character 5-gram Jaccard) is dropped"})


def read_prompts(path: Path) -> list[dict]:
    """The {"id", "messages"} lines of --train, each ending with the user turn it asks."""
    if not path.is_file():
        raise DataError(f"--train {path}: no such file; pass dflash.data.sharegpt's train_prompts.jsonl")
    prompts = []
    for lineno, raw in iter_lines(path):
        where = f"{path}:{lineno}"
        messages = parse_line(raw, where, require_reply=False)
        if messages[-1]["role"] != "user":
            raise DataError(f"{where}: not a prompt line ({{\"id\", \"messages\"}} ending with a user turn); "
                            "pass dflash.data.sharegpt's train_prompts.jsonl")
        prompts.append({"id": json.loads(raw).get("id") or f"line{lineno}", "messages": messages})
    return prompts


def build_prompts(args: LaterTurnsArgs) -> tuple[int, Counter]:
    """Write --out; return (prompts written, later turns dropped by reason)."""
    if args.min_chars < 1:
        raise DataError(f"--min-chars {args.min_chars}: use at least 1")
    heldout = heldout_index(args.heldout, args.near_dup)
    problem = output_file_problem(Path(args.out))
    if problem:
        raise DataError(f"--out {args.out}: {problem}; pass a file path you can write to")
    prompts = read_prompts(Path(args.train))
    seen = {Fingerprint.of(p["messages"][-1]["content"]).digest for p in prompts if len(p["messages"]) == 1}
    kept, dropped = [], Counter()
    for prompt in prompts:
        if len(prompt["messages"]) == 1:
            continue
        turn = prompt["messages"][-1]["content"]
        fingerprint = Fingerprint.of(turn)
        reason = (SHORT if len(turn) < args.min_chars else REPEATED if fingerprint.digest in seen
                  else HELDOUT if heldout.match(fingerprint) is not None else None)
        if reason:
            dropped[reason] += 1
            continue
        seen.add(fingerprint.digest)
        kept.append(json.dumps({"id": f"{prompt['id']}:alone", "messages": [{"role": "user", "content": turn}]}))
    write_text_durably(Path(args.out), "".join(line + "\n" for line in kept))
    return len(kept), dropped


def main(argv: list[str] | None = None) -> int:
    (args,) = cli_parser(LaterTurnsArgs).parse_args_into_dataclasses(argv)
    setup_logging(0)
    try:
        written, dropped = build_prompts(args)
    except DataError as err:
        return user_error(err)
    logger.info("dropped %s; %s: %d prompts", ", ".join(f"{dropped[r]} {r}" for r in (SHORT, REPEATED, HELDOUT)),
                args.out, written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
