"""Chat data -> tokenized shards -> padded batches (dflash/sampler.py picks the indices).

Pipeline:
  load_chat_jsonl      JSONL conversations (gzip too), each record read by dflash/chat_formats.py,
                       validated with file:line errors (prompt-only ones too, for regeneration
                       and evaluation: require_reply=False)
  load_tokenizer       a tokenizer folder (or a GGUF file's tokenizer) with a chat template
  tokenize_conversation  chat-template token ids + loss mask on assistant tokens
  prepare_dataset      writes a memmap shard directory (reused when up to date)
  TokenDataset         read-only view of a shard
  collate              right-padded tensors for one batch
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import time
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import numpy as np
import torch

# DataError and SampleError are the errors of the whole data path, imported from here too.
from dflash.chat_formats import DataError, Messages, SampleError, parse_record
from dflash.files import replace_dir, staging_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
OVERFLOW_POLICIES = ("truncate", "drop")
BAD_SAMPLE_POLICIES = ("skip", "error")
BAD_SAMPLES_FILE = "bad_samples.txt"
# Content beyond max_length x this many characters cannot reach the first max_length tokens
# (no tokenizer we know has longer tokens), so it is cut before tokenizing: a 14 MB line
# then costs what a max_length one does.
MAX_CHARS_PER_TOKEN = 64
PARALLEL_FROM_BYTES = 8 * 2**20  # smaller files are tokenized in one process
PROGRESS_EVERY_S = 10.0
GZIP_MAGIC = b"\x1f\x8b"

MANIFEST = "manifest.json"
IDS_FILE = "ids.bin"
LOSS_MASK_FILE = "loss_mask.bin"
OFFSETS_FILE = "offsets.npy"
LENGTHS_FILE = "lengths.npy"


# ---------------------------------------------------------------------------
# JSONL loading


def load_chat_jsonl(path: str | Path, require_reply: bool = True) -> list[Messages]:
    """Read every conversation of a chat JSONL file (plain or gzip) as a list of messages (the
    formats: dflash/chat_formats.py); the first bad line raises a DataError naming it. Training
    needs an assistant reply in each; prompts (regeneration, evaluation: require_reply=False) may
    end in a user turn or be `{"prompt": ...}` alone, since only what precedes the final reply is used."""
    path = Path(path)
    return [parse_line(raw, f"{path}:{lineno}", require_reply) for lineno, raw in _iter_lines(path)]


def _iter_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """Yield (line number, raw bytes) for each non-blank line, decompressing a gzip file (told
    by its first bytes, not its name: `dflash.regenerate --output x.jsonl.gz` writes plain text)."""
    try:
        with path.open("rb") as probe:
            compressed = probe.read(len(GZIP_MAGIC)) == GZIP_MAGIC
        handle = gzip.open(path, "rb") if compressed else path.open("rb")
    except OSError as err:
        raise DataError(f"{path}: cannot open the data file ({err}); check the path") from err
    found, lineno = False, 0
    with handle:
        try:
            for lineno, raw in enumerate(handle, start=1):
                if not raw.strip():
                    continue
                found = True
                yield lineno, raw
        except (OSError, EOFError, zlib.error) as err:  # gzip's: BadGzipFile (an OSError), EOFError, zlib.error
            raise DataError(f"{path}: cannot read past line {lineno} ({err}); the file is corrupt or cut "
                            "short: copy it again") from err
    if not found:
        raise DataError(f"{path}: no conversations (the file is empty or only blank lines); "
                        "pass a JSONL file with one conversation per line")


def parse_line(raw: bytes, where: str, require_reply: bool = True) -> Messages:
    """One JSONL line -> messages; raises SampleError naming `where`."""
    return parse_record(_parse_json(_decode_line(raw, where), where), where, require_reply)


def _decode_line(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8-sig")  # -sig: tolerate a byte-order mark on the first line
    except UnicodeDecodeError as err:
        raise SampleError(f"{where}: not valid UTF-8 ({err.reason}); re-encode the file as UTF-8",
                          "not UTF-8") from err


def _parse_json(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise SampleError(f"{where}: malformed JSON ({err.msg} at column {err.colno}); "
                          "each line must be one JSON object", "malformed JSON") from err


# ---------------------------------------------------------------------------
# Tokenization


LOSS_TURNS = ("last", "all")


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: Messages, max_chars: int | None = None, loss_turns: str = "last"
) -> tuple[np.ndarray, np.ndarray]:
    """Return (token ids int32, loss mask bool) of a conversation rendered by the chat template.

    The mask is True on what the last assistant turn produces (`loss_turns="all"`: every
    assistant turn): its content, the tool calls the template renders in it, and its end-of-turn
    token, never the role header. The last is the default because regeneration replaces only the
    final reply: earlier replies of a multi-turn prompt are the dataset's text, which the target
    never wrote. A turn's characters are found by rendering the conversation
    up to the turn with a generation prompt (span start) and including the turn (span end),
    both of which must be TEXT prefixes of the full render; the full render is tokenized once,
    and the tokens overlapping those characters are the turn's. Contents longer than
    `max_chars` are cut first (see MAX_CHARS_PER_TOKEN).
    """
    _require_chat_template(tokenizer)
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not replies:
        raise SampleError("conversation has no assistant turn; nothing to put in the loss mask", "no assistant turn")
    if replies[0] == 0:
        # Templates cannot render the empty prompt that would mark where the reply starts.
        raise SampleError("conversation starts with an assistant turn; put a user or system message before it",
                          "starts with an assistant turn")
    # Turns after the last reply carry no loss and cannot affect it (causal), so skip them.
    messages = [{**m, "content": m["content"][:max_chars]} for m in messages[: replies[-1] + 1]]
    text = _render_text(tokenizer, messages, add_generation_prompt=False)
    encoded = _encode_with_offsets(tokenizer, text)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    mask = np.zeros(len(ids), dtype=bool)
    for turn in replies if loss_turns == "all" else replies[-1:]:
        start = _render_text(tokenizer, messages[:turn], add_generation_prompt=True)
        end = _render_text(tokenizer, messages[: turn + 1], add_generation_prompt=False)
        _check_text_prefix(start, end, turn, "the generation prompt", "the turn")
        _check_text_prefix(end, text, turn, "the turn", "the whole conversation")
        _check_tool_calls_rendered(messages[turn], end[len(start):], turn)
        first, last = _token_span(offsets, len(start), len(end))
        mask[first:_reply_end(tokenizer, ids, first, last)] = True
    return np.asarray(ids, dtype=np.int32), mask


# Any one of these makes a folder a tokenizer that transformers can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """Load a tokenizer folder, or the tokenizer a GGUF file carries; it must have a chat template."""
    from transformers import AutoTokenizer  # heavy import, only needed here

    from dflash.gguf_target import from_pretrained_args  # imports transformers too

    name, kwargs = from_pretrained_args(name_or_path)
    if not kwargs and Path(name).is_dir() and not any((Path(name) / f).exists() for f in TOKENIZER_FILES):
        raise DataError(f"--tokenizer {name_or_path} (default: --target): the folder holds no tokenizer files "
                        f"({', '.join(TOKENIZER_FILES)}); copy the model's tokenizer into it, or pass --tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as err:
        raise DataError(f"--tokenizer {name_or_path}: cannot load a tokenizer ({err}); pass a "
                        "folder with tokenizer files and a chat template, or a GGUF file") from err
    _require_chat_template(tokenizer)
    return tokenizer


def prompt_messages(messages: Messages) -> Messages:
    """The conversation up to its last non-assistant turn: what the final reply answers."""
    end = len(messages)
    while end > 0 and messages[end - 1]["role"] == "assistant":
        end -= 1
    if end == 0:
        raise DataError("conversation has no user turn to prompt with")
    return messages[:end]


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: Messages, **template_kwargs) -> list[int]:
    """Token ids of the conversation up to its last non-assistant turn, with the generation
    prompt: what a model is given to produce the final assistant reply (evaluation,
    regeneration). `template_kwargs` go to the chat template (e.g. enable_thinking)."""
    _require_chat_template(tokenizer)
    return _render_ids(tokenizer, prompt_messages(messages), add_generation_prompt=True, **template_kwargs)


def _require_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"tokenizer {tokenizer.name_or_path!r} has no chat_template; "
                        "pass a tokenizer with a chat template (--tokenizer)")


def _render_text(tokenizer: PreTrainedTokenizerBase, messages: Messages, add_generation_prompt: bool,
                 **template_kwargs) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **template_kwargs)
    except (jinja2.TemplateError, ValueError) as err:
        raise SampleError(f"the chat template failed to render a conversation prefix ({err}); "
                          "check the data or pass a different --tokenizer", "template error") from err


def _render_ids(tokenizer: PreTrainedTokenizerBase, messages: Messages, add_generation_prompt: bool,
                **template_kwargs) -> list[int]:
    """Render with the chat template as text, then tokenize without adding extra specials."""
    # The template already writes any BOS; add_special_tokens would duplicate it.
    text = _render_text(tokenizer, messages, add_generation_prompt, **template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _encode_with_offsets(tokenizer: PreTrainedTokenizerBase, text: str):
    try:
        return tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as err:  # only "fast" (Rust) tokenizers report character offsets
        raise DataError(f"tokenizer {tokenizer.name_or_path!r} cannot report character offsets; "
                        "pass a fast tokenizer (a tokenizer.json) with --tokenizer") from err


def _check_text_prefix(prefix: str, full: str, turn: int, prefix_name: str, full_name: str) -> None:
    if not full.startswith(prefix):
        raise SampleError(f"assistant turn messages[{turn}]: the chat template is not prefix-stable "
                          f"({prefix_name} does not render as a prefix of {full_name}), so the "
                          "assistant tokens cannot be located; pass a --tokenizer whose template "
                          "renders earlier turns unchanged", "template not prefix-stable")


def _check_tool_calls_rendered(message: dict[str, Any], turn_text: str, turn: int) -> None:
    """A template that ignores tool_calls would train the reply without its calls: refuse it."""
    for call in message.get("tool_calls", ()):
        name = call["function"]["name"]
        if name not in turn_text:
            raise SampleError(f"assistant turn messages[{turn}]: the chat template does not render its tool call "
                              f"{name!r}, so the turn would train without it; pass a --tokenizer whose template "
                              "renders tool_calls, or drop them from the data", "tool calls not rendered")


def _token_span(offsets: list[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """Tokens [first, last) that overlap characters [start, end)."""
    first = next((i for i, (a, b) in enumerate(offsets) if b > start), len(offsets))
    last = next((i for i in range(first, len(offsets)) if offsets[i][0] >= end), len(offsets))
    return first, last


def _reply_end(tokenizer: PreTrainedTokenizerBase, ids: list[int], first: int, last: int) -> int:
    """End of the assistant span: just after its end-of-turn token, skipping template whitespace.

    Templates often write a newline after the end-of-turn token; generation
    stops at that token, so the newline is not something the model produces.
    """
    special = _special_ids(tokenizer)
    for pos in range(last - 1, first - 1, -1):
        if ids[pos] in special:
            return pos + 1 if not tokenizer.decode(ids[pos + 1:last]).strip() else last
    return last


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return set(tokenizer.all_special_ids) | {i for i, tok in added.items() if tok.special}


# ---------------------------------------------------------------------------
# Shard preparation


@dataclass
class PrepareStats:
    """What prepare_dataset did with the samples of one file."""

    samples_read: int = 0
    samples_kept: int = 0
    samples_truncated: int = 0  # kept, but cut at max_length
    samples_dropped: int = 0  # too long under "drop", or no loss token left after truncation
    samples_bad: int = 0  # skipped under --on-bad-sample skip, listed in bad_samples.txt
    bad_reasons: dict[str, int] = field(default_factory=dict)
    num_tokens: int = 0
    num_loss_tokens: int = 0


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
) -> Path:
    """Tokenize a chat JSONL file into a shard directory and return its path (`workers`
    processes; 0: `default_prepare_workers`).

    A shard that is already up to date for this source file, tokenizer and
    settings is reused. The shard is written to a temporary directory and
    renamed into place, so an interrupted run never leaves a valid-looking one.
    Bad samples stop the preparation (`on_bad_sample="error"`) or are skipped, counted by
    reason and listed with file:line in <shard>/bad_samples.txt, up to `max_bad_fraction`
    of the samples read.
    """
    if overflow not in OVERFLOW_POLICIES:
        raise DataError(f"--overflow must be one of {list(OVERFLOW_POLICIES)}, got {overflow!r}")
    if on_bad_sample not in BAD_SAMPLE_POLICIES:
        raise DataError(f"--on-bad-sample must be one of {list(BAD_SAMPLE_POLICIES)}, got {on_bad_sample!r}")
    if max_length < 1:
        raise DataError(f"--max-length must be a positive number of tokens, got {max_length}")
    if loss_turns not in LOSS_TURNS:
        raise DataError(f"--loss-turns must be one of {list(LOSS_TURNS)}, got {loss_turns!r}")
    _require_chat_template(tokenizer)
    source, out = Path(jsonl_path), Path(out_dir)
    settings = {
        "format_version": FORMAT_VERSION,
        "max_length": max_length,
        "overflow": overflow,
        "on_bad_sample": on_bad_sample,
        "max_bad_fraction": max_bad_fraction,
        "loss_turns": loss_turns,
        "source": _source_identity(source),
        "tokenizer": _tokenizer_identity(tokenizer),
    }
    if _is_up_to_date(out, settings):
        logger.info("reusing prepared data in %s (same source, tokenizer and settings)", out)
        return out
    _check_replaceable(out)
    staging = staging_dir(out)
    try:
        workers = workers or default_prepare_workers(source)
        started = time.perf_counter()
        stats, lengths = _write_token_files(staging, source, tokenizer, max_length, overflow,
                                            on_bad_sample, max_bad_fraction, workers, loss_turns)
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
        manifest = _read_manifest(out)
        _check_data_files(out, manifest)
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


def _write_token_files(
    staging: Path,
    source: Path,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    overflow: str,
    on_bad_sample: str,
    max_bad_fraction: float,
    workers: int = 1,
    loss_turns: str = "last",
) -> tuple[PrepareStats, list[int]]:
    """Stream every kept sample into ids.bin / loss_mask.bin; return stats and sample lengths.
    Lines are tokenized by `workers` processes (in file order, so the shard is the same)."""
    stats, lengths, bad = PrepareStats(), [], []
    progress = _Progress(source)
    with (staging / IDS_FILE).open("wb") as ids_file, (staging / LOSS_MASK_FILE).open("wb") as mask_file, \
            _tokenized_lines(source, tokenizer, (max_length * MAX_CHARS_PER_TOKEN, loss_turns), workers) as results:
        for result in results:
            stats.samples_read += 1
            progress.update(stats.samples_read)
            if isinstance(result, SampleError):
                if on_bad_sample == "error":
                    raise DataError(f"{result} (--on-bad-sample skip would skip it)") from result
                bad.append((result.reason, str(result)))
                stats.bad_reasons[result.reason] = stats.bad_reasons.get(result.reason, 0) + 1
                continue
            ids, mask = result
            truncated = len(ids) > max_length
            if truncated and overflow == "drop":
                stats.samples_dropped += 1
                continue
            ids, mask = ids[:max_length], mask[:max_length]
            if not mask.any():
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
    if not stats.samples_kept:
        raise DataError(_nothing_kept_message(source, stats, max_length, overflow))
    return stats, lengths


def _nothing_kept_message(source: Path, stats: PrepareStats, max_length: int, overflow: str) -> str:
    """Why no sample is left when some were dropped at --max-length (all bad: _report_bad_samples)."""
    why = ("longer than it under --overflow drop; raise --max-length or use --overflow truncate" if overflow == "drop"
           else "no assistant token within it; raise --max-length")
    bad = f", and the other {stats.samples_bad} are bad ({_reason_counts(stats)})" if stats.samples_bad else ""
    return (f"{source}: no sample left to train on: {stats.samples_dropped} of {stats.samples_read} were dropped at "
            f"--max-length={max_length} ({why}){bad}")


def _tokenize_line(item: tuple[int, bytes], source: Path, tokenizer, options: tuple[int, str]):
    """(ids, mask) of one line, or the SampleError naming it (file:line); options: (max_chars,
    loss_turns) of tokenize_conversation."""
    lineno, raw = item
    where = f"{source}:{lineno}"
    try:
        return tokenize_conversation(tokenizer, parse_line(raw, where), *options)
    except SampleError as err:
        message = str(err) if str(err).startswith(where) else f"{where}: {err}"
        return SampleError(message, err.reason)


_worker_args: tuple = ()


def _init_worker(source: Path, tokenizer, options: tuple[int, str]) -> None:
    global _worker_args
    _worker_args = (source, tokenizer, options)


def _tokenize_in_worker(item: tuple[int, bytes]):
    return _tokenize_line(item, *_worker_args)


@contextlib.contextmanager
def _tokenized_lines(source: Path, tokenizer, options: tuple[int, str], workers: int):
    """Every line's tokenization result, in file order, from this process or a pool. Spawned
    (not forked) workers: the parent may hold threads (tokenizers, process groups)."""
    if workers <= 1:
        yield (_tokenize_line(item, source, tokenizer, options) for item in _iter_lines(source))
        return
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=(source, tokenizer, options)) as pool:
        yield pool.imap(_tokenize_in_worker, _iter_lines(source), chunksize=64)


def default_prepare_workers(source: Path) -> int:
    """All cores (up to 32) for files worth it; one process for small files, where starting a
    pool costs more than it saves."""
    try:
        size = source.stat().st_size
    except OSError:
        return 1
    return 1 if size < PARALLEL_FROM_BYTES else max(1, min(os.cpu_count() or 1, 32))


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


def _log_overflow(stats: PrepareStats, max_length: int, overflow: str) -> None:
    """One summary warning rather than one line per sample."""
    if stats.samples_truncated or stats.samples_dropped:
        logger.warning(
            "max_length=%d, overflow=%s: %d of %d samples truncated, %d dropped",
            max_length, overflow, stats.samples_truncated, stats.samples_read, stats.samples_dropped,
        )


def write_index_and_manifest(
    staging: Path, lengths: list[int], stats: PrepareStats, settings: dict[str, Any]
) -> None:
    lengths_arr = np.asarray(lengths, dtype=np.int64)
    offsets = np.zeros_like(lengths_arr)
    np.cumsum(lengths_arr[:-1], out=offsets[1:])
    np.save(staging / OFFSETS_FILE, offsets)
    np.save(staging / LENGTHS_FILE, lengths_arr)
    manifest = {
        **settings,
        "num_samples": stats.samples_kept,
        "num_tokens": stats.num_tokens,
        "stats": asdict(stats),
    }
    # The manifest goes last: its presence marks a complete shard.
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _read_manifest(shard_dir: Path) -> dict[str, Any]:
    path = shard_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except OSError as err:
        raise DataError(f"{path}: no readable manifest ({err}); prepare the data first "
                        "(prepare_dataset) or point to a prepared-data directory") from err
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: manifest is not valid JSON; delete {shard_dir} and "
                        "prepare the data again") from err
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        found = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise DataError(f"{path}: data format version {found!r}, this code reads "
                        f"{FORMAT_VERSION}; delete {shard_dir} and prepare the data again")
    if not all(isinstance(manifest.get(key), int) for key in ("num_samples", "num_tokens")):
        raise DataError(f"{path}: manifest lacks num_samples/num_tokens; delete {shard_dir} "
                        "and prepare the data again")
    return manifest


def _check_data_files(shard_dir: Path, manifest: dict[str, Any]) -> None:
    """The data files must exist with exactly the sizes the manifest promises."""
    expected = {IDS_FILE: 4 * manifest["num_tokens"], LOSS_MASK_FILE: manifest["num_tokens"]}
    for name, size in expected.items():
        path = shard_dir / name
        if not path.is_file() or path.stat().st_size != size:
            raise DataError(f"{path}: missing or not {size} bytes as the manifest says; "
                            f"delete {shard_dir} and prepare the data again")
    for name in (OFFSETS_FILE, LENGTHS_FILE):
        if not (shard_dir / name).is_file():
            raise DataError(f"{shard_dir / name}: missing; delete {shard_dir} and prepare "
                            "the data again")


# ---------------------------------------------------------------------------
# Reading shards


class TokenDataset:
    """Read-only, memory-mapped samples of a prepared shard directory."""

    def __init__(self, shard_dir: str | Path) -> None:
        self.shard_dir = Path(shard_dir)
        self.manifest = _read_manifest(self.shard_dir)
        _check_data_files(self.shard_dir, self.manifest)
        num_tokens = self.manifest["num_tokens"]
        self._ids = np.memmap(self.shard_dir / IDS_FILE, dtype=np.int32, mode="r", shape=(num_tokens,))
        self._mask = np.memmap(
            self.shard_dir / LOSS_MASK_FILE, dtype=np.uint8, mode="r", shape=(num_tokens,)
        )
        self._offsets = np.load(self.shard_dir / OFFSETS_FILE)
        self._lengths = np.load(self.shard_dir / LENGTHS_FILE)
        if len(self._lengths) != self.manifest["num_samples"] or len(self._offsets) != len(self._lengths):
            raise DataError(f"{self.shard_dir}: index files disagree with the manifest; "
                            "delete it and prepare the data again")

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Return (token ids int64, loss mask bool) of one sample, copied out of the memmap."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        start = int(self._offsets[index])
        stop = start + int(self._lengths[index])
        return self._ids[start:stop].astype(np.int64), self._mask[start:stop].astype(bool)

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths

    def anchor_candidates(self, chunk_tokens: int = 1 << 26) -> np.ndarray:
        """Per sample, how many positions could anchor a block (loss mask at a and a+1, as
        `objective.anchor_candidates`), read in chunks of whole samples so a corpus of billions
        of tokens needs no more memory than a chunk."""
        counts = np.zeros(len(self), dtype=np.int64)
        ends = self._offsets + self._lengths
        first = 0
        while first < len(self):
            start = int(self._offsets[first])
            last = int(np.searchsorted(ends, start + chunk_tokens, side="right"))
            last = max(last, first + 1)
            stop = int(ends[last - 1])
            mask = np.asarray(self._mask[start:stop], dtype=bool)
            pairs = np.concatenate([mask[:-1] & mask[1:], [False]]) if len(mask) else mask
            # a pair across two samples is no candidate: the last token of each sample starts none
            pairs[(ends[first:last] - 1 - start)[self._lengths[first:last] > 0]] = False
            sums = np.concatenate([[0], np.cumsum(pairs, dtype=np.int64)])
            counts[first:last] = sums[ends[first:last] - start] - sums[self._offsets[first:last] - start]
            first = last
        return counts


# ---------------------------------------------------------------------------
# Batching


def collate(dataset: TokenDataset, indices: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad the given samples into a batch of tensors."""
    if not indices:
        raise ValueError("collate needs at least one sample index")
    samples = [dataset[i] for i in indices]
    lengths = torch.tensor([len(ids) for ids, _ in samples], dtype=torch.long)
    width = int(lengths.max())
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(samples), width), dtype=torch.bool)
    for row, (ids, mask) in enumerate(samples):
        input_ids[row, : len(ids)] = torch.from_numpy(ids)
        loss_mask[row, : len(mask)] = torch.from_numpy(mask)
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "attention_mask": torch.arange(width)[None, :] < lengths[:, None],
        "lengths": lengths,
        "sample_ids": torch.tensor(indices, dtype=torch.long),
    }


if __name__ == "__main__":  # python -m dflash.data prepare|stats ...
    import sys

    from dflash.data_tools import main

    sys.exit(main())
