"""Chat JSONL -> a tokenized shard directory, in parallel, with progress: prepare_dataset.

Reused when up to date (same source, tokenizer and settings); written to a staging folder and
renamed into place; bad samples skipped (listed in the shard's bad_samples.txt) or fatal; replies
cut at the regeneration's length limit kept (never closed by an end-of-turn token) or dropped;
files of 8 MB and more tokenized by a spawned process pool, in file order, so the shard is the same.
Reading a shard: dflash/data/dataset.py; its files and manifest: dflash/data/shards.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dflash.data.chat_formats import THINKING_MODES, DataError, SampleError, iter_lines, parse_sample
from dflash.data.shards import (BAD_SAMPLES_FILE, FORMAT_VERSION, IDS_FILE, LOSS_MASK_FILE, MANIFEST, PrepareStats,
                                check_data_files, read_manifest, write_index_and_manifest)
from dflash.data.thinking import mismatch_error
from dflash.data.tokenization import (LOSS_TURNS, MAX_CHARS_PER_TOKEN, TokenSequence, conversation_sequences,
                                     require_chat_template)
from dflash.util.files import replace_dir, staging_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


OVERFLOW_POLICIES = ("truncate", "drop")
BAD_SAMPLE_POLICIES = ("skip", "error")
CUT_REPLY_POLICIES = ("keep", "drop")  # replies whose target_reply.finish_reason is "length"
DEFAULT_CUT_REPLIES = "drop"  # launch/ab_cut_replies.sh: held-out tau 1.36 against 1.33 for keep (BENCHMARKS.md)

PARALLEL_FROM_BYTES = 8 * 2**20  # smaller files are tokenized in one process
MAX_PREPARE_WORKERS = 16  # past this, starting the spawned workers costs more than they save
PROGRESS_EVERY_S = 10.0


def prepare_dataset(
    jsonl_path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | Path,
    max_length: int,
    overflow: str = "truncate",
    on_bad_sample: str = "skip",
    max_bad_fraction: float = 0.01,
    workers: int = 0,
    loss_turns: str = "last",
    thinking: str = "none",
    cut_replies: str = DEFAULT_CUT_REPLIES,
) -> Path:
    """Tokenize a chat JSONL file into a shard directory and return its path (`workers`
    processes; 0: `default_prepare_workers`), prompts rendered in the resolved `thinking` mode
    (dflash/data/thinking.py): a record whose target_reply.thinking differs stops it.

    A shard that is already up to date for this source file, tokenizer and
    settings is reused. The shard is written to a temporary directory and
    renamed into place, so an interrupted run never leaves a valid-looking one.
    Bad samples stop the preparation (`on_bad_sample="error"`) or are skipped, counted by
    reason and listed with file:line in <shard>/bad_samples.txt, up to `max_bad_fraction`
    of the samples read. Replies cut at the length limit (target_reply.finish_reason "length") are
    kept without an end-of-turn token, or dropped (`cut_replies="drop"`), and counted.
    """
    _check_options(max_length, overflow, on_bad_sample, loss_turns, thinking, cut_replies)
    require_chat_template(tokenizer)
    source, out = Path(jsonl_path), Path(out_dir)
    # what a reused shard must have been prepared with
    settings = {"format_version": FORMAT_VERSION, "max_length": max_length, "overflow": overflow,
                "on_bad_sample": on_bad_sample, "max_bad_fraction": max_bad_fraction, "loss_turns": loss_turns,
                "thinking": thinking, "cut_replies": cut_replies, "source": _source_identity(source),
                "tokenizer": _tokenizer_identity(tokenizer)}
    if _is_up_to_date(out, settings):
        logger.info("reusing prepared data in %s (same source, tokenizer and settings)", out)
        return out
    _check_replaceable(out)
    staging = staging_dir(out)
    try:
        workers = workers or default_prepare_workers(source)
        started = time.perf_counter()
        options = LineOptions(max_length * MAX_CHARS_PER_TOKEN, loss_turns, thinking, cut_replies)
        stats, lengths = _write_token_files(staging, source, tokenizer, max_length, overflow,
                                            on_bad_sample, max_bad_fraction, workers, options)
        seconds = time.perf_counter() - started
        logger.info("tokenized %d samples in %.1f s (%.0f samples/s, %d process%s)", stats.samples_read, seconds,
                    stats.samples_read / max(seconds, 1e-9), workers, "es" if workers > 1 else "")
        write_index_and_manifest(staging, lengths, stats, settings)
        replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("prepared %s: %s", out, stats)
    if stats.samples_bad:
        logger.warning("%s: skipped %d bad samples of %d (%s); each is listed in %s", source, stats.samples_bad,
                       stats.samples_read, stats.bad_reasons, out / BAD_SAMPLES_FILE)
    return out


def _check_options(max_length: int, overflow: str, on_bad_sample: str, loss_turns: str, thinking: str,
                   cut_replies: str) -> None:
    for flag, value, allowed in (("--overflow", overflow, OVERFLOW_POLICIES),
                                 ("--on-bad-sample", on_bad_sample, BAD_SAMPLE_POLICIES),
                                 ("--loss-turns", loss_turns, LOSS_TURNS),
                                 ("--cut-replies", cut_replies, CUT_REPLY_POLICIES)):
        if value not in allowed:
            raise DataError(f"{flag} must be one of {list(allowed)}, got {value!r}")
    if max_length < 1:
        raise DataError(f"--max-length must be a positive number of tokens, got {max_length}")
    if thinking not in THINKING_MODES:
        raise DataError(f"thinking must be a resolved mode, one of {list(THINKING_MODES)}, got {thinking!r}")


def _source_identity(source: Path) -> dict[str, Any]:
    """Path, size and mtime: enough to notice that the data file changed."""
    try:
        st = source.stat()
    except OSError as err:
        raise DataError(f"{source}: cannot read the data file ({err}); check the path") from err
    return {"path": str(source.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """Name, vocab length and a hash of vocab + template, since names can hide changes."""
    content = json.dumps(
        [sorted(tokenizer.get_vocab().items()), tokenizer.chat_template, tokenizer.all_special_tokens]
    )
    return {
        "name_or_path": tokenizer.name_or_path,
        "vocab_size": len(tokenizer),
        "fingerprint": hashlib.sha256(content.encode()).hexdigest(),
    }


def _is_up_to_date(out: Path, settings: dict[str, Any]) -> bool:
    try:
        manifest = read_manifest(out)
        check_data_files(out, manifest)
    except DataError:
        return False
    return all(manifest.get(key) == value for key, value in settings.items())


def _check_replaceable(out: Path) -> None:
    """Refuse to overwrite anything that is not an empty directory or an earlier shard."""
    if not out.exists():
        return
    if not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST).exists()):
        raise DataError(f"{out}: exists and is not a prepared-data directory; "
                        "choose another output directory or remove it")


@dataclass(frozen=True)
class LineOptions:
    """How every line is tokenized (conversation_sequences' settings), sent once to each worker."""

    max_chars: int
    loss_turns: str
    thinking: str
    cut_replies: str


@dataclass
class _Line:
    """One line's training sequences (none: a cut reply dropped), and whether its reply was cut."""

    sequences: list[TokenSequence]
    cut: bool


def _write_token_files(
    staging: Path,
    source: Path,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    overflow: str,
    on_bad_sample: str,
    max_bad_fraction: float,
    workers: int,
    options: LineOptions,
) -> tuple[PrepareStats, list[int]]:
    """Stream every kept sequence into ids.bin / loss_mask.bin; return stats and sequence lengths.
    Lines are tokenized by `workers` processes (in file order, so the shard is the same)."""
    stats, lengths, bad = PrepareStats(), [], []
    progress = _Progress(source)
    with (staging / IDS_FILE).open("wb") as ids_file, (staging / LOSS_MASK_FILE).open("wb") as mask_file, \
            _tokenized_lines(source, tokenizer, options, workers) as results:
        for result in results:
            stats.samples_read += 1
            progress.update(stats.samples_read)
            if isinstance(result, SampleError):
                if on_bad_sample == "error":
                    raise DataError(f"{result} (--on-bad-sample skip would skip it)") from result
                bad.append((result.reason, str(result)))
                stats.bad_reasons[result.reason] = stats.bad_reasons.get(result.reason, 0) + 1
                continue
            stats.samples_cut += int(result.cut)
            stats.samples_cut_dropped += int(result.cut and not result.sequences)
            stats.samples_split_by_turn += int(len(result.sequences) > 1)
            for ids, mask in result.sequences:
                truncated = len(ids) > max_length
                ids, mask = ids[:max_length], mask[:max_length]
                if (truncated and overflow == "drop") or not mask.any():
                    stats.samples_dropped += 1
                    continue
                stats.samples_truncated += int(truncated)
                stats.samples_kept += 1
                stats.num_tokens += len(ids)
                stats.num_loss_tokens += int(mask.sum())
                lengths.append(len(ids))
                ids.tofile(ids_file)
                mask.astype(np.uint8).tofile(mask_file)
    stats.samples_bad = len(bad)
    _report_bad_samples(staging, source, stats, bad, max_bad_fraction)
    _log_overflow(stats, max_length, overflow)
    _log_cut_replies(stats, options.cut_replies)
    if not stats.samples_kept:
        raise DataError(_nothing_kept_message(source, stats, max_length, overflow))
    return stats, lengths


def _nothing_kept_message(source: Path, stats: PrepareStats, max_length: int, overflow: str) -> str:
    """Why no sample is left when some were dropped at --max-length or as cut replies (all bad:
    _report_bad_samples)."""
    why = ("longer than it under --overflow drop; raise --max-length or use --overflow truncate" if overflow == "drop"
           else "no assistant token within it; raise --max-length")
    cut = (f", {stats.samples_cut_dropped} were replies cut at the regeneration's length limit, dropped by "
           "--cut-replies drop (keep them with --cut-replies keep)" if stats.samples_cut_dropped else "")
    bad = f", and the other {stats.samples_bad} are bad ({_reason_counts(stats)})" if stats.samples_bad else ""
    return (f"{source}: no sample left to train on: {stats.samples_dropped} of {stats.samples_read} were dropped at "
            f"--max-length={max_length} ({why}){cut}{bad}")


def _tokenize_line(item: tuple[int, bytes], source: Path, tokenizer, options: LineOptions):
    """One line's _Line, or the SampleError naming it (file:line). A reply generated in another
    thinking mode than this preparation's stops it (a DataError)."""
    lineno, raw = item
    where = f"{source}:{lineno}"
    try:
        messages, reply = parse_sample(raw, where)
        if reply is not None and reply.thinking is not None and reply.thinking != options.thinking:
            raise mismatch_error(reply.thinking, f"{where}: target_reply", options.thinking, "the data")
        cut = reply is not None and reply.cut
        if cut and options.cut_replies == "drop":
            return _Line([], cut)
        return _Line(conversation_sequences(tokenizer, messages, reply, options.max_chars, options.loss_turns,
                                        options.thinking), cut)
    except SampleError as err:
        message = str(err) if str(err).startswith(where) else f"{where}: {err}"
        return SampleError(message, err.reason)


_worker_args: tuple = ()


def _init_worker(source: Path, tokenizer, options: LineOptions) -> None:
    global _worker_args
    _worker_args = (source, tokenizer, options)


def _tokenize_in_worker(item: tuple[int, bytes]):
    return _tokenize_line(item, *_worker_args)


@contextlib.contextmanager
def _tokenized_lines(source: Path, tokenizer, options: LineOptions, workers: int):
    """Every line's tokenization result, in file order, from this process or a pool."""
    if workers <= 1:
        yield (_tokenize_line(item, source, tokenizer, options) for item in iter_lines(source))
        return
    with _main_left_alone(unless_needed_by=tokenizer):
        pool = _pool_context(tokenizer).Pool(workers, initializer=_init_worker, initargs=(source, tokenizer, options))
    with pool:
        yield pool.imap(_tokenize_in_worker, iter_lines(source), chunksize=64)


def _pool_context(tokenizer):
    """Never fork the parent: it may hold threads (tokenizers, process groups). A fork server (a
    fresh process that imports this module and the tokenizer's once, then forks each worker)
    where the platform has one; spawn, which imports them in every worker, elsewhere."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__, type(tokenizer).__module__])
    return context


@contextlib.contextmanager
def _main_left_alone(unless_needed_by: object):
    """Workers started meanwhile do not run the launching script again. Started from a script
    (train_drafter.py), each worker would first re-run it as its own main module, importing
    torch, DeepSpeed and the rest (1.2-1.8 s of a 2-core CPU per worker, while the pool starts
    them one after another: 16 workers took 24 s to start there, and a 16-core GPU host waited
    133 s). They need only this module, so the script's path is hidden from them while they
    start. (The fork server's own `__main__` preload, meant for this, is a no-op on Python 3.11:
    it reads a key the preparation data does not have.)"""
    main = sys.modules["__main__"]
    if type(unless_needed_by).__module__ == "__main__":  # a tokenizer class the script defines
        yield
        return
    path = main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        if path is not None:
            main.__file__ = path


def default_prepare_workers(source: Path) -> int:
    """The cores this process may use (up to 16) for files worth it; one process for small files,
    where starting a pool costs more than it saves. os.cpu_count() counts the host's cores, not a
    container's or a job's share: more workers than usable cores made tokenizing slower than one."""
    try:
        size = source.stat().st_size
    except OSError:
        return 1
    return 1 if size < PARALLEL_FROM_BYTES else max(1, min(usable_cores(), MAX_PREPARE_WORKERS))


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), where the platform says."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class _Progress:
    """A throughput line every PROGRESS_EVERY_S seconds while tokenizing."""

    def __init__(self, source: Path):
        self.source, self.started = source, time.perf_counter()
        self.last = self.started

    def update(self, samples: int) -> None:
        now = time.perf_counter()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            logger.info("%s: %d samples tokenized, %.0f samples/s", self.source, samples, samples / (now - self.started))


def _report_bad_samples(staging: Path, source: Path, stats: PrepareStats, bad: list[tuple[str, str]],
                        max_bad_fraction: float) -> None:
    """List the skipped samples in the shard; fail when they are more than the bound allows."""
    if not bad:
        return
    (staging / BAD_SAMPLES_FILE).write_text("".join(f"{reason}: {message}\n" for reason, message in bad))
    fraction = len(bad) / stats.samples_read
    first = "\n  ".join(message for _, message in bad[:3])
    if fraction == 1:
        raise DataError(f"{source}: all {len(bad)} samples are bad ({_reason_counts(stats)}). The first:\n  {first}\n"
                        "Fix the data: skipping them all (--max-bad-fraction) would leave nothing to train on.")
    if fraction > max_bad_fraction:
        raise DataError(f"{source}: {len(bad)} of {stats.samples_read} samples are bad ({fraction:.1%}, above "
                        f"--max-bad-fraction {max_bad_fraction:g}; {_reason_counts(stats)}). The first:\n  {first}\n"
                        "Fix the data, or raise --max-bad-fraction to skip them all.")


def _reason_counts(stats: PrepareStats) -> str:
    return ", ".join(f"{reason}: {n}" for reason, n in sorted(stats.bad_reasons.items()))


def _log_cut_replies(stats: PrepareStats, cut_replies: str) -> None:
    if stats.samples_cut:
        logger.warning("%d of %d replies were cut at the regeneration's length limit (target_reply.finish_reason "
                       "length): %s", stats.samples_cut, stats.samples_read,
                       f"dropped {stats.samples_cut_dropped} (--cut-replies drop)" if cut_replies == "drop"
                       else "trained as cut, without an end-of-turn token (--cut-replies keep)")


def _log_overflow(stats: PrepareStats, max_length: int, overflow: str) -> None:
    """One summary warning rather than one line per sample."""
    if stats.samples_truncated or stats.samples_dropped:
        logger.warning(
            "max_length=%d, overflow=%s: %d of %d samples truncated, %d dropped",
            max_length, overflow, stats.samples_truncated, stats.samples_read, stats.samples_dropped,
        )
