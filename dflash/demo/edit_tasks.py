"""Text-editing chats for the demo target: a ShareGPT passage and an instruction (repeat it, quote
it, number its sentences, ...) whose answer is made from the passage.

A target of a few million parameters trained on free chat replies answers in loops (its greedy
text repeats a phrase), and one that memorised a small corpus answers from its weights. Trained on
these tasks, it answers from its prompt, as real models do when they edit, summarise or quote
what they were given; that is the behaviour a drafter learns from the target's features.

    python -m dflash.demo.edit_tasks --source sharegpt/train_conversations.jsonl --output chats.jsonl --count 16000
    python -m dflash.demo.edit_tasks --source sharegpt/train_conversations.jsonl --output heldout.jsonl \
        --count 16000 --split heldout --prompts-only

--split picks the chats that a target built from the same chats (build_target --chats) trains on
or holds out (dflash/demo/chat_corpus.py's split), so the demo's held-out prompts are passages
its target never saw.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from dflash.data.chat_formats import DataError, load_chat_jsonl
from dflash.demo.chat_corpus import is_heldout
from dflash.util.cli import ConfigError, cli_parser, user_error

# passages: whole paragraphs of prose this long, so that an answer fits in the demo's 128 new tokens
MIN_CHARS, MAX_CHARS = 80, 400
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=\S)")


def sentences(text: str) -> list[str]:
    return [s.strip() for s in SENTENCE_END.split(text) if s.strip()]


def quoted(text: str) -> str:
    return "\n".join("> " + line for line in text.splitlines())


def numbered(text: str) -> str:
    return "\n".join(f"{i}. {s}" for i, s in enumerate(sentences(text), 1))


def bulleted(text: str) -> str:
    return "\n".join(f"- {s}" for s in sentences(text))


# (instruction, answer from the passage)
TASKS: list[tuple[str, Callable[[str], str]]] = [
    ("Repeat the following text word for word.", lambda t: t),
    ('Quote the following text, starting each line with "> ".', quoted),
    ("Split the following text into sentences, one per line, numbered.", numbered),
    ("Turn the following text into a bulleted list, one sentence per bullet.", bulleted),
    ("What is the first sentence of the following text?", lambda t: f'The first sentence is: "{sentences(t)[0]}"'),
    ("What is the last sentence of the following text?", lambda t: f'The last sentence is: "{sentences(t)[-1]}"'),
    ('Put the following text in a JSON object under the key "text".', lambda t: json.dumps({"text": t})),
]


def passages(messages: list[dict]) -> Iterator[str]:
    """The prose paragraphs of a conversation (code, lists and tables left out)."""
    for message in messages:
        for paragraph in message["content"].split("\n\n"):
            paragraph = paragraph.strip()
            if (MIN_CHARS <= len(paragraph) <= MAX_CHARS and paragraph.isascii() and "```" not in paragraph
                    and not paragraph.lstrip().startswith(("-", "*", "|", "#")) and paragraph[0].isalpha()):
                yield paragraph


def task_for(passage: str, seed: int) -> tuple[str, Callable[[str], str]]:
    """The task depends on the passage and the seed alone, not on the file order."""
    digest = hashlib.sha256(f"{seed}:{passage}".encode()).digest()
    return TASKS[int.from_bytes(digest[:4], "little") % len(TASKS)]


def edit_chat(passage: str, seed: int) -> dict:
    instruction, answer = task_for(passage, seed)
    return {"messages": [{"role": "user", "content": f"{instruction}\n\n{passage}"},
                         {"role": "assistant", "content": answer(passage)}]}


@dataclass
class EditTaskArgs:
    source: list[str] = field(metadata={"help": "chat JSONL files whose messages give the passages"})
    output: str = field(metadata={"help": "chat JSONL to write"})
    count: int = field(default=0, metadata={"help": "at most this many chats, from a shuffle of all passages (0: all)"})
    split: str = field(default="all", metadata={"help": "all | train | heldout (see above)"})
    prompts_only: bool = field(default=False, metadata={
        "help": "write the instructions alone (for a target to answer: dflash.regenerate, --eval-data)"})
    seed: int = 0


def write_edit_tasks(args: EditTaskArgs) -> int:
    """Write the chats; returns how many."""
    if args.split not in ("all", "train", "heldout"):
        raise ConfigError(f"--split {args.split}: use all, train or heldout")
    found = list(dict.fromkeys(p for path in args.source for m in load_chat_jsonl(path, require_reply=False)
                               for p in passages(m)))
    if not found:
        raise ConfigError(f"--source {' '.join(args.source)}: no prose paragraph of {MIN_CHARS}-{MAX_CHARS} "
                          "characters; pass chat files with prose in them")
    if args.count:
        random.Random(args.seed).shuffle(found)
        found = found[:args.count]
    chats = [edit_chat(passage, args.seed) for passage in found]
    if args.split != "all":
        chats = [c for c in chats if is_heldout(c["messages"]) == (args.split == "heldout")]
    with open(args.output, "w") as out:
        for chat in chats:
            out.write(json.dumps({"messages": chat["messages"][:1]} if args.prompts_only else chat) + "\n")
    return len(chats)


def main(argv: list[str] | None = None) -> int:
    (args,) = cli_parser(EditTaskArgs).parse_args_into_dataclasses(argv)
    try:
        written = write_edit_tasks(args)
    except (ConfigError, DataError) as err:
        return user_error(err)
    print(f"wrote {written} chats to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
