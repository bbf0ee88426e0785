"""Prompts the target writes itself (the Magpie technique): the target is given the chat template's
user header alone (a conversation of one user message, rendered and cut where the message's text
would start, so it carries the template's default system prompt), samples a user turn and ends it
with its end-of-turn token. The turns that pass the filters become prompt-only chat JSONL, which
`python -m dflash.regenerate` then answers:

    python -m dflash.data.magpie --target T --n 100000 --out runs/real/data/magpie_prompts.jsonl \\
        --heldout runs/real/data/heldout.jsonl [--code-share 0.5]
    cat runs/real/data/train_prompts.jsonl runs/real/data/magpie_prompts.jsonl > runs/real/data/prompts.jsonl

Each line is {"id": "magpie:<n>", "messages": [{"role": "user", "content": TURN}]}. Turns are
sampled (temperature 1.0, top-p 0.99 by default) on the static-cache engine (dflash.target.generate:
Llama, Mistral, Qwen2/3 targets). Every row draws its own random numbers, so rows that share the
header write different turns; --seed repeats a run on the same device and --batch-tokens.

A sampled turn is dropped, and counted in the summary, when it:
  - was cut at --max-new-tokens: no end-of-turn token, the turn is unfinished;
  - is shorter than --min-chars or longer than --max-chars characters (whitespace stripped);
  - is under 80% ASCII: other scripts, as for ShareGPT (prompt_filters.mostly_ascii);
  - repeats a user turn of a --heldout file, exactly or as a near-duplicate;
  - repeats a turn kept before it: the same text after normalising case, punctuation and spacing,
    or a near-duplicate, an estimated Jaccard similarity of character 5-grams of at least --near-dup
    (MinHash with LSH buckets, O(N) for N turns: dflash/data/prompt_filters.py);
  - with --code-share, falls in a class (looks like a code request or not, by
    prompt_filters.looks_like_code) whose quota is already full.

--code-share S keeps round(S x N) turns that look like code requests and the rest others. To fill
the code quota without sampling many turns for nothing, a share of each round's rows get
--code-system-prompt as the system message of their header, which steers the target toward code
requests: the code quota's share of the turns still missing. The written prompts hold the user turn
alone, so regeneration answers them under the template's default system prompt, as users are served.

Rows are sampled in rounds. A round samples what is still missing divided by the share of rows that
passed the filters so far (x1.1; 1.25 x what is missing in the first round; at most 10 x). After
--max-rounds rounds the turns kept so far are written, and the summary says how many are missing.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import torch

from dflash.data.chat_formats import DataError
from dflash.data.prompt_filters import Fingerprint, NearDuplicates, looks_like_code, mostly_ascii, user_turns
from dflash.data.tokenization import load_tokenizer, require_chat_template
from dflash.target.frozen import FrozenTarget, TargetError, load_target_config
from dflash.target.generate import generate_batches, stop_token_ids
from dflash.target.gguf import is_model_path, resolve_target
from dflash.target.sampling import Sampling
from dflash.target.static import FAST_FAMILIES
from dflash.util.cli import ConfigError, cli_parser, user_error
from dflash.util.files import output_dir_problem, write_text_durably
from dflash.util.runtime import pick_device, setup_logging

logger = logging.getLogger(__name__)

MARKER = "MAGPIE7Q2XUSERTURN"  # a user message's text, found in the render to cut the header at
CODE_SYSTEM_PROMPT = ("You are a coding assistant. Users ask you to write, explain, fix and review code in many "
                      "programming languages.")
FIRST_ROUND = 1.25  # rows of the first round, per turn missing
ROUND_MARGIN = 1.1  # later rounds: missing / the share of rows kept so far, times this
MAX_ROUND = 10  # ... and at most this many rows per turn missing
ID_PREFIX = "magpie"

# What each filter drops, as the summary words it (keys of BuildReport.dropped), in the order applied.
CUT, SHORT, LONG, NOT_ASCII, HELDOUT, EXACT, NEAR, OVER_QUOTA = (
    "cut at --max-new-tokens", "shorter than --min-chars", "longer than --max-chars", "under 80% ASCII",
    "repeating a --heldout turn", "exact duplicates", "near-duplicates", "over the --code-share quota")
FILTERS = (CUT, SHORT, LONG, NOT_ASCII, HELDOUT, EXACT, NEAR, OVER_QUOTA)


@dataclass
class MagpieArgs:
    target: str = field(metadata={"help": "HF causal-LM folder or .gguf file: the target that writes the prompts "
                                          "(and will answer them)"})
    n: int = field(metadata={"help": "prompts to write"})
    out: str = field(metadata={"help": "chat JSONL to write (prompt-only: --prompts of dflash.regenerate)"})
    heldout: list[str] = field(default_factory=list, metadata={
        "help": "chat JSONL files (e.g. dflash.data.sharegpt's heldout.jsonl) whose user turns no prompt may repeat"})
    tokenizer: str | None = field(default=None, metadata={"help": "default: --target"})
    max_new_tokens: int = field(default=512, metadata={"help": "longest user turn sampled, in tokens"})
    min_chars: int = field(default=20, metadata={"help": "shortest turn kept, in characters"})
    max_chars: int = field(default=4000, metadata={"help": "longest turn kept, in characters"})
    near_dup: float = field(default=0.6, metadata={
        "help": "a turn whose character 5-gram Jaccard similarity with a kept one reaches this is dropped"})
    code_share: float | None = field(default=None, metadata={
        "help": "share of the prompts that look like code requests, 0..1 (default: whatever the target writes)"})
    code_system_prompt: str = field(default=CODE_SYSTEM_PROMPT, metadata={
        "help": "system message of the rows steered toward code under --code-share ('': steer none)"})
    temperature: float = 1.0
    top_p: float = 0.99
    top_k: int = field(default=0, metadata={"help": "0: every token"})
    batch_tokens: int = field(default=0, metadata={
        "help": "at most rows x (header + --max-new-tokens) per batch; 0: sized from the target's shapes and the "
                "free memory, as dflash.regenerate's"})
    max_rounds: int = 8
    device: str = "auto"
    dtype: str = field(default="bfloat16", metadata={"help": "bfloat16 | float32"})
    seed: int = 0


def user_header(tokenizer, system: str | None = None) -> str:
    """The chat template's render of a conversation of one user message (after a system message
    `system`, when given), cut where the message's text starts: what the target sees before a
    user writes. Without `system` it holds the template's default system prompt, if it has one."""
    require_chat_template(tokenizer)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": MARKER}]
    where = "with --code-system-prompt" if system else "a user message alone"
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    except (jinja2.TemplateError, ValueError) as err:
        raise DataError(f"the chat template of {tokenizer.name_or_path!r} cannot render {where} ({err}); "
                        + ("pass --code-system-prompt ''" if system else "pass a --tokenizer with a chat template"))
    if text.count(MARKER) != 1:
        raise DataError(f"the chat template of {tokenizer.name_or_path!r} does not render a user message's text "
                        f"as given ({where}), so the user header cannot be cut from it; pass another --tokenizer")
    return text[: text.index(MARKER)]


def sampled_turns(target: FrozenTarget, headers: dict[int, list[int]], max_new_tokens: int, stop_ids: set[int],
                  batch_tokens: int, sampling: Sampling) -> Iterator[tuple[int, list[int], bool]]:
    """Each row's sampled turn, as the engine finishes them: (the row, its token ids with the stop
    token left out, whether it ended with one)."""
    for rows, replies in generate_batches(target, headers, max_new_tokens, stop_ids, batch_tokens=batch_tokens,
                                          sampling=sampling):
        for row, reply in zip(rows, replies):
            yield row, *turn_of(reply, max_new_tokens, stop_ids)


def turn_of(reply, max_new_tokens: int, stop_ids: set[int]) -> tuple[list[int], bool]:
    """(token ids without the stop token, whether the turn ended) of one engine reply: a
    (token_ids, finish_reason) pair as the engines yield them (token_ids end with the stop token
    when finish_reason is "stop"), or a bare list of ids without the stop token, which ended when
    it is shorter than max_new_tokens."""
    if isinstance(reply, tuple):
        ids, reason = reply
        ended = reason == "stop"
        return (list(ids[:-1]) if ended and ids and ids[-1] in stop_ids else list(ids)), ended
    return list(reply), len(reply) < max_new_tokens


class PromptPool:
    """The turns kept so far, and what each filter dropped (module docstring, in FILTERS order)."""

    def __init__(self, n: int, min_chars: int, max_chars: int, near_dup: float, code_share: float | None,
                 heldout: list[str]) -> None:
        self.min_chars, self.max_chars = min_chars, max_chars
        self.index = NearDuplicates(near_dup)
        for text in heldout:
            self.index.add(Fingerprint.of(text))
        self.heldout = len(self.index)  # the index's first entries are the held-out turns
        self.by_class = code_share is not None  # classes: True (code request), False; else None alone
        code = round(code_share * n) if self.by_class else 0
        self.quota: dict[bool | None, int] = {True: code, False: n - code} if self.by_class else {None: n}
        self.kept: list[str] = []
        self.kept_by_class: Counter = Counter()
        self.passed: Counter = Counter()  # per class: turns that passed every filter but the quota
        self.dropped: Counter = Counter()

    def offer(self, text: str, ended: bool) -> str | None:
        """Keep `text` (whitespace stripped), or return the filter that drops it."""
        text = text.strip()
        problem = self.problem(text, ended)
        if problem is None:
            fingerprint = Fingerprint.of(text)
            match = self.index.match(fingerprint)
            if match is not None:
                problem = HELDOUT if match.index < self.heldout else EXACT if match.exact else NEAR
            else:
                kind = looks_like_code(text) if self.by_class else None
                self.passed[kind] += 1
                if self.kept_by_class[kind] >= self.quota[kind]:
                    problem = OVER_QUOTA
                else:
                    self.index.add(fingerprint)
                    self.kept.append(text)
                    self.kept_by_class[kind] += 1
        if problem:
            self.dropped[problem] += 1
        return problem

    def problem(self, text: str, ended: bool) -> str | None:
        if not ended:
            return CUT
        if len(text) < self.min_chars:
            return SHORT
        if len(text) > self.max_chars:
            return LONG
        return None if mostly_ascii(text) else NOT_ASCII

    def missing(self) -> dict[bool | None, int]:
        return {kind: quota - self.kept_by_class[kind] for kind, quota in self.quota.items()}

    def full(self) -> bool:
        return not any(self.missing().values())


def plan_round(missing: dict[bool | None, int], passed: Counter, rows_so_far: int, steer: bool) -> tuple[int, int]:
    """(rows with the default header, rows steered toward code) for the next round: enough, at the
    yield of the rows so far, for the class that needs the most rows (module docstring)."""
    total = sum(missing.values())
    if rows_so_far == 0:
        rows = math.ceil(FIRST_ROUND * total)
    else:
        rows = max(math.ceil(ROUND_MARGIN * count * rows_so_far / passed[kind]) if passed[kind] else MAX_ROUND * total
                   for kind, count in missing.items() if count)
        rows = min(rows, MAX_ROUND * total)
    steered = round(rows * missing.get(True, 0) / total) if steer and total else 0
    return rows - steered, steered


@dataclass
class BuildReport:
    rows: int = 0  # sampled turns offered to the filters
    steered: int = 0  # ... of them under --code-system-prompt
    rounds: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    pool: PromptPool | None = None


def check_args(args: MagpieArgs) -> None:
    problems = [
        (args.n >= 1, f"--n {args.n}: use at least 1"),
        (args.max_new_tokens >= 1, f"--max-new-tokens {args.max_new_tokens}: use at least 1"),
        (1 <= args.min_chars <= args.max_chars,
         f"--min-chars {args.min_chars} --max-chars {args.max_chars}: use 1 <= --min-chars <= --max-chars"),
        (0 < args.near_dup <= 1, f"--near-dup {args.near_dup}: use a similarity in (0, 1]"),
        (args.code_share is None or 0 <= args.code_share <= 1,
         f"--code-share {args.code_share}: use a share in [0, 1]"),
        (args.temperature > 0, f"--temperature {args.temperature}: use more than 0 (the turns are sampled)"),
        (0 < args.top_p <= 1, f"--top-p {args.top_p}: use a value in (0, 1]"),
        (args.top_k >= 0, f"--top-k {args.top_k}: use 0 (every token) or more"),
        (args.batch_tokens >= 0, f"--batch-tokens {args.batch_tokens}: use 0 (sized from memory) or a token count"),
        (args.max_rounds >= 1, f"--max-rounds {args.max_rounds}: use at least 1"),
        (args.dtype in ("bfloat16", "float32"), f"--dtype {args.dtype}: use bfloat16 or float32"),
        (is_model_path(args.target),
         f"--target {args.target}: no such folder or .gguf file; pass a local HF model folder or a GGUF file"),
        (not Path(args.out).is_dir(), f"--out {args.out} is a folder: pass a file path in it, such as "
                                      f"{Path(args.out) / 'magpie_prompts.jsonl'}"),
    ] + [(Path(path).is_file(), f"--heldout {path}: no such file; pass a chat JSONL file") for path in args.heldout]
    for ok, message in problems:
        if not ok:
            raise ConfigError(message)
    folder = Path(args.out).parent
    problem = output_dir_problem(folder)
    if problem:
        raise ConfigError(f"--out {args.out}: its folder {folder} {problem}; pass a path you can write to")


def load_target(args: MagpieArgs) -> FrozenTarget:
    """The target on the static-cache engine's families (a GGUF file de-quantized first)."""
    served = resolve_target(args.target)
    family = load_target_config(served).model_type
    if family not in FAST_FAMILIES:
        raise ConfigError(f"--target {args.target}: a {family} model; prompts are sampled on the static-cache "
                          f"engine, which runs {', '.join(FAST_FAMILIES)} targets")
    return FrozenTarget.load(served, [0], getattr(torch, args.dtype), pick_device(args.device, 0))


def build_prompts(args: MagpieArgs) -> BuildReport:
    """Sample turns in rounds until --n pass the filters (or --max-rounds ran), write --out."""
    check_args(args)
    started = time.perf_counter()
    tokenizer = load_tokenizer(args.tokenizer or args.target)
    steer = bool(args.code_share and args.code_system_prompt)
    headers = [user_header(tokenizer)] + ([user_header(tokenizer, args.code_system_prompt)] if steer else [])
    header_ids = [tokenizer(h, add_special_tokens=False)["input_ids"] for h in headers]
    pool = PromptPool(args.n, args.min_chars, args.max_chars, args.near_dup, args.code_share,
                      user_turns(args.heldout))
    report = BuildReport(pool=pool)
    logger.info("user header: %r%s; %d held-out turns", headers[0],
                f", steered: {headers[1]!r}" if steer else "", pool.heldout)
    target = load_target(args)
    stop_ids = stop_token_ids(target.model.generation_config, tokenizer)
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    while report.rounds < args.max_rounds and not pool.full():
        plain, steered = plan_round(pool.missing(), pool.passed, report.rows, steer)
        rows = {row: header_ids[int(row >= plain)] for row in range(plain + steered)}
        torch.manual_seed(args.seed + report.rounds)
        offered = report.rows
        for row, ids, ended in sampled_turns(target, rows, args.max_new_tokens, stop_ids, args.batch_tokens,
                                             sampling):
            pool.offer(tokenizer.decode(ids, skip_special_tokens=True), ended)
            report.rows += 1
            report.steered += row >= plain
            report.new_tokens += len(ids)
            if pool.full():
                break  # the rest of the round is not sampled
        report.rounds += 1
        logger.info("round %d: %d turns sampled, %d of %d prompts kept so far, %.0f new tokens/s", report.rounds,
                    report.rows - offered, len(pool.kept), args.n, report.new_tokens / (time.perf_counter() - started))
    write_text_durably(Path(args.out), "".join(
        json.dumps({"id": f"{ID_PREFIX}:{i}", "messages": [{"role": "user", "content": text}]}) + "\n"
        for i, text in enumerate(pool.kept)))
    report.seconds = time.perf_counter() - started
    return report


def summary(report: BuildReport, args: MagpieArgs) -> list[str]:
    """The lines logged at the end: what was sampled, what each filter dropped, what was written."""
    pool = report.pool
    code = sum(map(looks_like_code, pool.kept))
    missing = args.n - len(pool.kept)
    lines = [
        f"sampled {report.rows} user turns in {report.rounds} rounds ({report.steered} with --code-system-prompt), "
        f"{report.new_tokens} new tokens in {report.seconds:.1f} s",
        "dropped: " + ", ".join(f"{pool.dropped[f]} {f}" for f in FILTERS),
        f"{args.out}: {len(pool.kept)} prompts, {code} of them code requests",
    ]
    if missing:
        lines.append(f"{missing} prompts short of --n {args.n} after --max-rounds {args.max_rounds}: raise "
                     "--max-rounds" + (", or change --code-share" if args.code_share is not None else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    (args,) = cli_parser(MagpieArgs).parse_args_into_dataclasses(argv)
    setup_logging(0)
    try:
        report = build_prompts(args)
    except (ConfigError, DataError, TargetError) as err:
        return user_error(err)
    lines = summary(report, args)
    for line in lines[:3]:
        logger.info("%s", line)
    for line in lines[3:]:
        logger.warning("%s", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
