"""The demo corpus: Python standard library sources, split into train and held-out files.

The stdlib is present on every machine that can run this project, so the demo assets
can be rebuilt offline. Both build scripts share the snippet sampler here so that the
target is trained on exactly the prompt format that the drafter data later uses.
"""

import bisect
import hashlib
import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Directories whose contents are tests, generated tables, GUI demos, vendored wheels or
# machine-specific build data: noisy for a tiny model and not representative code.
EXCLUDED_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "turtledemo",
        "ensurepip",
        "encodings",
        "pydoc_data",
        "__pycache__",
        "lib2to3",
        "distutils",
    }
)
# Files that are mostly data or depend on the build machine.
EXCLUDED_PREFIXES = ("_sysconfigdata", "config-")
# One file in ten is held out; the hash makes the split independent of the file order
# and of which other files exist in a given Python installation.
HELDOUT_MODULUS = 10
MAX_LINE_CHARS = 120
PROMPT_PREFIX = "Continue this Python code:\n"

# ChatML as used by Qwen. Every message ends in "<|im_end|>\n" and the generation
# prompt is exactly the header of the next assistant message, so rendering
# messages[:i] with a generation prompt is a prefix of rendering messages[:i + 1].
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class SourceFile:
    """One stdlib module: its path relative to the stdlib root and its lines."""

    rel_path: str
    lines: tuple[str, ...]


def stdlib_root() -> Path:
    """This interpreter's stdlib, or DFLASH_DEMO_CORPUS: a copy of another version's, so that the
    demo assets can be rebuilt on a host with another Python."""
    return Path(os.environ.get("DFLASH_DEMO_CORPUS") or sysconfig.get_paths()["stdlib"])


def _is_excluded(rel: Path) -> bool:
    if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
        return True
    return any(part.startswith(EXCLUDED_PREFIXES) for part in rel.parts)


def is_heldout(rel_path: str) -> bool:
    """Deterministic ~10% file-level split keyed only on the relative path."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_MODULUS == 0


def load_sources(heldout: bool) -> list[SourceFile]:
    """All usable stdlib .py files of one split, in sorted path order."""
    root = stdlib_root()
    sources = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _is_excluded(rel) or is_heldout(rel.as_posix()) != heldout:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        lines = tuple(line.rstrip() for line in text.expandtabs(4).splitlines())
        if lines:
            sources.append(SourceFile(rel.as_posix(), lines))
    return sources


# Lines per snippet: the prompt's code, and the real continuation the target is trained on.
PROMPT_LINES = (8, 20)
RESPONSE_LINES = (10, 30)


def user_prompt(code: str) -> str:
    return PROMPT_PREFIX + code


class SnippetSampler:
    """Draws (prompt code, continuation) pairs of consecutive lines from a file set.

    Start positions are uniform over all lines of the corpus, so large modules
    contribute in proportion to their size rather than one sample per file.
    """

    def __init__(self, sources: list[SourceFile], seed: int) -> None:
        self.sources = sources
        self.rng = random.Random(seed)
        self.cumulative: list[int] = []
        total = 0
        for source in sources:
            total += len(source.lines)
            self.cumulative.append(total)

    def _acceptable(self, lines: tuple[str, ...]) -> bool:
        # Snippets that are mostly blank or contain very long (usually data) lines
        # teach little about code structure.
        non_blank = sum(1 for line in lines if line.strip())
        too_long = any(len(line) > MAX_LINE_CHARS for line in lines)
        return non_blank >= 0.6 * len(lines) and not too_long

    def sample(self, prompt_lines: tuple[int, int], response_lines: tuple[int, int]) -> tuple[str, str]:
        """Rejection-sample until a window of the requested line counts qualifies."""
        while True:
            n_prompt = self.rng.randint(*prompt_lines)
            n_response = self.rng.randint(*response_lines)
            position = self.rng.randrange(self.cumulative[-1])
            index = bisect.bisect_right(self.cumulative, position)
            lines = self.sources[index].lines
            start = position - (self.cumulative[index] - len(lines))
            window = lines[start : start + n_prompt + n_response]
            if len(window) < n_prompt + n_response or not self._acceptable(window):
                continue
            prompt, response = window[:n_prompt], window[n_prompt:]
            if not response[0].strip():
                # A leading newline would fuse with the newline that ends the assistant
                # header into one token, so the prompt would not be a token prefix.
                continue
            return "\n".join(prompt), "\n".join(response)
