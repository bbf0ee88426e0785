"""The flag parser of every dflash command: HfArgumentParser over typed dataclasses, with a
--help that lists each flag once, in its dash spelling, and its default once.

ConfigError: a flag value that cannot work, named with the fix (every command's checks)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable

from transformers import HfArgumentParser


def cli_parser(dataclass_types: type | Iterable[type]) -> HfArgumentParser:
    """HfArgumentParser registers each field as both --x_y and --x-y: both still parse (the
    parser keeps every spelling), but --help and the usage line show --x-y alone."""
    parser = HfArgumentParser(dataclass_types, formatter_class=argparse.HelpFormatter)
    if parser.prog == "__main__.py":  # `python -m dflash.<package>`: argparse names the file
        parser.prog = f"python -m {sys.modules['__main__'].__spec__.name.removesuffix('.__main__')}"
    for action in parser._actions:
        spellings = action.option_strings
        action.option_strings = [s for s in spellings if "_" not in s or s.replace("_", "-") not in spellings]
        action.help = help_with_default(action.help, action.default)
    return parser


def help_with_default(text: str | None, default) -> str | None:
    """The help with "(default: ...)" appended, unless it already speaks of its default, or the
    default is None (the help says what leaving the flag out means)."""
    if default is None or default is argparse.SUPPRESS or (text and "default" in text.lower()):
        return text
    return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def without_launcher_flags(argv: list[str]) -> list[str]:
    """The deepspeed launcher appends --local_rank=N; LOCAL_RANK in the environment says the same."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.split("=")[0] in ("--local_rank", "--local-rank"):
            skip = "=" not in arg
        else:
            kept.append(arg)
    return kept


def user_error(err: Exception) -> int:
    """A user's mistake ends a command in one line on stderr, no traceback: exit status 2."""
    print(f"error: {err}", file=sys.stderr)
    return 2


class ConfigError(ValueError):
    """A flag value that cannot work, named with the fix."""
