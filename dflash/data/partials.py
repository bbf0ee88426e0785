"""Regeneration's partial files and its output. Every rank appends its finished replies to its own
file (rank 0: <output>.partial, rank r: <output>.rank<r>.partial), a line each, flushed per batch;
a rerun with any number of ranks reads all of them, so a killed run resumes where each rank stopped.
At the end one rank writes <output> from all of them, in input order, and deletes them.

A line is {"index": <conversation>, "reply": <text>, "target_reply": {...}}: everything the
output record holds but the prompt turns, which the rerun reads from --prompts again.
"""

from __future__ import annotations

import glob
import json
import re
from collections.abc import Iterator
from pathlib import Path

from dflash.data.chat_formats import DataError, Messages
from dflash.data.tokenization import prompt_messages
from dflash.util.files import write_lines_durably

RANK_FILE = re.compile(r"\.rank(\d+)\.partial")


def partial_path(output: Path, rank: int) -> Path:
    return output.with_name(f"{output.name}.partial" if rank == 0 else f"{output.name}.rank{rank}.partial")


def partial_files(output: Path) -> list[Path]:
    """Every rank's partial file beside `output`, whatever the number of ranks that wrote them."""
    ranks = {0}
    for path in output.parent.glob(f"{glob.escape(output.name)}.rank*.partial"):
        match = RANK_FILE.fullmatch(path.name[len(output.name):])
        if match:
            ranks.add(int(match.group(1)))
    return [path for path in (partial_path(output, rank) for rank in sorted(ranks)) if path.is_file()]


def read_partials(output: Path) -> tuple[dict[int, str], int]:
    """Each finished conversation's line (index -> the line), and how many lines were dropped: the
    torn last line of a killed rank, or a line without the reply's token ids (an older format)."""
    lines: dict[int, str] = {}
    dropped = 0
    for path in partial_files(output):
        with path.open(encoding="utf-8") as f:
            for line in f:
                index = _index_of(line)
                if index is None:
                    dropped += 1
                else:
                    lines.setdefault(index, line.rstrip("\n"))
    return lines, dropped


def _index_of(line: str) -> int | None:
    try:
        record = json.loads(line)
        reply = record["target_reply"]
        if isinstance(record["reply"], str) and isinstance(reply["token_ids"], list) and reply["finish_reason"]:
            return int(record["index"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        pass
    return None


class PartialSink:
    """This rank's partial file, opened for appending; a torn last line (the rank was killed while
    writing it) is cut off first, so the next line does not join it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> PartialSink:
        self.path.touch()
        _cut_torn_line(self.path)
        self._file = self.path.open("a", encoding="utf-8")
        return self

    def write(self, index: int, reply: str, target_reply: dict) -> None:
        self._file.write(json.dumps({"index": index, "reply": reply, "target_reply": target_reply}) + "\n")

    def flush(self) -> None:
        self._file.flush()

    def __exit__(self, *exc) -> None:
        self._file.close()


def _cut_torn_line(path: Path, chunk: int = 1 << 16) -> None:
    """Truncate `path` after its last newline, reading back from the end only as far as needed."""
    with path.open("r+b") as f:
        end = f.seek(0, 2)
        f.seek(max(0, end - 1))
        if end == 0 or f.read(1) == b"\n":
            return
        stop = end
        while stop > 0:
            start = max(0, stop - chunk)
            f.seek(start)
            newline = f.read(stop - start).rfind(b"\n")
            if newline >= 0:
                f.truncate(start + newline + 1)
                return
            stop = start
        f.truncate(0)


def write_output(output: Path, conversations: list[Messages], lines: dict[int, str]) -> None:
    """<output>: each conversation's prompt turns, the target's reply and its record, in input
    order; then the partial files go. A conversation without a line is an error naming it."""
    missing = [i for i in range(len(conversations)) if i not in lines]
    if missing:
        raise DataError(
            f"{len(missing)} of {len(conversations)} replies are in no partial file beside {output} (the first: "
            f"conversation {missing[0] + 1}); every rank must write into one filesystem that rank 0 reads: put "
            "--output on a shared one; run the same command again to generate the missing replies")
    write_lines_durably(output, _records(conversations, lines))
    for path in partial_files(output):
        path.unlink()


def _records(conversations: list[Messages], lines: dict[int, str]) -> Iterator[str]:
    for index, messages in enumerate(conversations):
        done = json.loads(lines[index])
        record = {"messages": [*prompt_messages(messages), {"role": "assistant", "content": done["reply"]}],
                  "target_reply": done["target_reply"]}
        yield json.dumps(record, ensure_ascii=False) + "\n"
