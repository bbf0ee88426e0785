"""Chat data -> tokenized shards -> padded batches (dflash/sampler.py picks the indices).

Pipeline:
  load_chat_jsonl      JSONL conversations, validated with file:line errors
  load_tokenizer       a tokenizer folder with a chat template
  tokenize_conversation  chat-template token ids + loss mask on assistant tokens
  prepare_dataset      writes a memmap shard directory (reused when up to date)
  TokenDataset         read-only view of a shard
  collate              right-padded tensors for one batch
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
ROLES = ("system", "user", "assistant", "tool")
OVERFLOW_POLICIES = ("truncate", "drop")

MANIFEST = "manifest.json"
IDS_FILE = "ids.bin"
LOSS_MASK_FILE = "loss_mask.bin"
OFFSETS_FILE = "offsets.npy"
LENGTHS_FILE = "lengths.npy"

Messages = list[dict[str, str]]


class DataError(ValueError):
    """Bad input data or settings; the message says what, where and what to do."""


# ---------------------------------------------------------------------------
# JSONL loading


def load_chat_jsonl(path: str | Path) -> list[Messages]:
    """Read every conversation of a chat JSONL file as a list of role/content messages."""
    return [messages for _, messages in _iter_chat_jsonl(Path(path))]


def _iter_chat_jsonl(path: Path) -> Iterator[tuple[int, Messages]]:
    """Yield (line number, messages) for each non-blank line; raise DataError on bad input."""
    try:
        handle = path.open("rb")
    except OSError as err:
        raise DataError(f"{path}: cannot open the data file ({err}); check the path") from err
    found = False
    with handle:
        for lineno, raw in enumerate(handle, start=1):
            where = f"{path}:{lineno}"
            line = _decode_line(raw, where)
            if not line.strip():
                continue
            found = True
            yield lineno, _parse_record(_parse_json(line, where), where)
    if not found:
        raise DataError(f"{path}: no conversations (the file is empty or only blank lines); "
                        "pass a JSONL file with one conversation per line")


def _decode_line(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8-sig")  # -sig: tolerate a byte-order mark on the first line
    except UnicodeDecodeError as err:
        raise DataError(f"{where}: not valid UTF-8 ({err.reason}); re-encode the file as UTF-8") from err


def _parse_json(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: malformed JSON ({err.msg} at column {err.colno}); "
                        "each line must be one JSON object") from err


def _parse_record(record: Any, where: str) -> Messages:
    """Turn one JSON line into messages, accepting the `messages` or `prompt`/`response` form."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    has_messages = "messages" in record
    has_pair = "prompt" in record or "response" in record
    if has_messages == has_pair:
        raise DataError(f"{where}: expected either a 'messages' list or 'prompt' and 'response' "
                        f"strings, got keys {sorted(record)}")
    if has_messages:
        messages = _parse_messages(record["messages"], where)
    else:
        messages = [
            {"role": "user", "content": _string_field(record, "prompt", where)},
            {"role": "assistant", "content": _string_field(record, "response", where)},
        ]
    _check_assistant_replies(messages, where)
    return messages


def _string_field(record: dict, key: str, where: str) -> str:
    """Return record[key], which must be a string."""
    value = record.get(key)
    if not isinstance(value, str):
        raise DataError(f"{where}: '{key}' must be a string, got {type(value).__name__}")
    return value


def _parse_messages(raw: Any, where: str) -> Messages:
    """Validate a messages list, keeping only role and content (extra keys are ignored)."""
    if not isinstance(raw, list) or not raw:
        raise DataError(f"{where}: 'messages' must be a non-empty list of "
                        "{'role': ..., 'content': ...} objects")
    messages = []
    for turn, message in enumerate(raw):
        turn_where = f"{where}: messages[{turn}]"
        if not isinstance(message, dict):
            raise DataError(f"{turn_where} must be an object, got {type(message).__name__}")
        role = _string_field(message, "role", turn_where)
        if role not in ROLES:
            raise DataError(f"{turn_where}: unknown role {role!r}; expected one of {list(ROLES)}")
        messages.append({"role": role, "content": _string_field(message, "content", turn_where)})
    return messages


def _check_assistant_replies(messages: Messages, where: str) -> None:
    """A conversation must train on something: at least one non-empty assistant turn."""
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not replies:
        raise DataError(f"{where}: conversation has no assistant turn, so nothing to train on; "
                        "add an assistant reply or remove the line")
    for turn in replies:
        if not messages[turn]["content"].strip():
            raise DataError(f"{where}: assistant turn messages[{turn}] has empty content; "
                            "fill it in or remove the line")


# ---------------------------------------------------------------------------
# Tokenization


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: Messages
) -> tuple[np.ndarray, np.ndarray]:
    """Return (token ids int32, loss mask bool) of a conversation rendered by the chat template.

    The mask is True on what each assistant turn produces: its content and its
    end-of-turn token, never the role header. Each turn's span is found by
    rendering the conversation up to the turn with a generation prompt (span
    start) and including the turn (span end); both renders must be token
    prefixes of the full render, otherwise the span would be guesswork.
    """
    _require_chat_template(tokenizer)
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not replies:
        raise DataError("conversation has no assistant turn; nothing to put in the loss mask")
    if replies[0] == 0:
        # Templates cannot render the empty prompt that would mark where the reply starts.
        raise DataError("conversation starts with an assistant turn; put a user or system "
                        "message before it")
    # Turns after the last reply carry no loss and cannot affect it (causal), so skip them.
    messages = messages[: replies[-1] + 1]
    ids = _render_ids(tokenizer, messages, add_generation_prompt=False)
    mask = np.zeros(len(ids), dtype=bool)
    for turn in replies:
        start = _render_ids(tokenizer, messages[:turn], add_generation_prompt=True)
        end = _render_ids(tokenizer, messages[: turn + 1], add_generation_prompt=False)
        _check_token_prefix(start, end, turn, "the generation prompt", "the turn")
        _check_token_prefix(end, ids, turn, "the turn", "the whole conversation")
        mask[len(start) : _reply_end(tokenizer, end, len(start))] = True
    return np.asarray(ids, dtype=np.int32), mask


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """Load a tokenizer folder, which must carry a chat template."""
    from transformers import AutoTokenizer  # heavy import, only needed here

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(name_or_path))
    except (OSError, ValueError) as err:
        raise DataError(f"--tokenizer {name_or_path}: cannot load a tokenizer ({err}); pass a "
                        "folder with tokenizer files and a chat template") from err
    _require_chat_template(tokenizer)
    return tokenizer


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: Messages) -> list[int]:
    """Token ids of the conversation up to its last non-assistant turn, with the generation
    prompt: what a model is given to produce the final assistant reply (for evaluation)."""
    _require_chat_template(tokenizer)
    end = len(messages)
    while end > 0 and messages[end - 1]["role"] == "assistant":
        end -= 1
    if end == 0:
        raise DataError("conversation has no user turn to prompt with")
    return _render_ids(tokenizer, messages[:end], add_generation_prompt=True)


def _require_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"tokenizer {tokenizer.name_or_path!r} has no chat_template; "
                        "pass a tokenizer with a chat template (--tokenizer)")


def _render_ids(
    tokenizer: PreTrainedTokenizerBase, messages: Messages, add_generation_prompt: bool
) -> list[int]:
    """Render with the chat template as text, then tokenize without adding extra specials."""
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except (jinja2.TemplateError, ValueError) as err:
        raise DataError(f"the chat template failed to render a conversation prefix ({err}); "
                        "check the data or pass a different --tokenizer") from err
    # The template already writes any BOS; add_special_tokens would duplicate it.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _check_token_prefix(
    prefix: list[int], full: list[int], turn: int, prefix_name: str, full_name: str
) -> None:
    if full[: len(prefix)] != prefix:
        raise DataError(f"assistant turn messages[{turn}]: the chat template is not prefix-stable "
                        f"({prefix_name} does not tokenize to a prefix of {full_name}), so the "
                        "assistant tokens cannot be located; pass a --tokenizer whose template "
                        "renders earlier turns unchanged")


def _reply_end(tokenizer: PreTrainedTokenizerBase, turn_ids: list[int], start: int) -> int:
    """End of the assistant span: just after its end-of-turn token, skipping template whitespace.

    Templates often write a newline after the end-of-turn token; generation
    stops at that token, so the newline is not something the model produces.
    """
    special = _special_ids(tokenizer)
    for pos in range(len(turn_ids) - 1, start - 1, -1):
        if turn_ids[pos] in special:
            tail = tokenizer.decode(turn_ids[pos + 1 :])
            return pos + 1 if not tail.strip() else len(turn_ids)
    return len(turn_ids)


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
    num_tokens: int = 0
    num_loss_tokens: int = 0


def prepare_dataset(
    jsonl_path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | Path,
    max_length: int,
    overflow: str = "truncate",
) -> Path:
    """Tokenize a chat JSONL file into a shard directory and return its path.

    A shard that is already up to date for this source file, tokenizer and
    settings is reused. The shard is written to a temporary directory and
    renamed into place, so an interrupted run never leaves a valid-looking one.
    """
    if overflow not in OVERFLOW_POLICIES:
        raise DataError(f"--overflow must be one of {list(OVERFLOW_POLICIES)}, got {overflow!r}")
    if max_length < 1:
        raise DataError(f"--max-length must be a positive number of tokens, got {max_length}")
    _require_chat_template(tokenizer)
    source, out = Path(jsonl_path), Path(out_dir)
    settings = {
        "format_version": FORMAT_VERSION,
        "max_length": max_length,
        "overflow": overflow,
        "source": _source_identity(source),
        "tokenizer": _tokenizer_identity(tokenizer),
    }
    if _is_up_to_date(out, settings):
        logger.info("reusing prepared data in %s (same source, tokenizer and settings)", out)
        return out
    _check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        stats, lengths = _write_token_files(staging, source, tokenizer, max_length, overflow)
        _write_index_and_manifest(staging, lengths, stats, settings)
        _replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("prepared %s: %s", out, stats)
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
) -> tuple[PrepareStats, list[int]]:
    """Stream every kept sample into ids.bin / loss_mask.bin; return stats and sample lengths."""
    stats, lengths = PrepareStats(), []
    with (staging / IDS_FILE).open("wb") as ids_file, (staging / LOSS_MASK_FILE).open("wb") as mask_file:
        for lineno, messages in _iter_chat_jsonl(source):
            stats.samples_read += 1
            try:
                ids, mask = tokenize_conversation(tokenizer, messages)
            except DataError as err:
                raise DataError(f"{source}:{lineno}: {err}") from err
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
    _log_overflow(stats, max_length, overflow)
    if not stats.samples_kept:
        raise DataError(f"{source}: all {stats.samples_read} samples were dropped (longer than "
                        f"--max-length={max_length} or no assistant token within it); raise "
                        "--max-length or use --overflow truncate")
    return stats, lengths


def _log_overflow(stats: PrepareStats, max_length: int, overflow: str) -> None:
    """One summary warning rather than one line per sample."""
    if stats.samples_truncated or stats.samples_dropped:
        logger.warning(
            "max_length=%d, overflow=%s: %d of %d samples truncated, %d dropped",
            max_length, overflow, stats.samples_truncated, stats.samples_read, stats.samples_dropped,
        )


def _write_index_and_manifest(
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


def _replace_dir(staging: Path, out: Path) -> None:
    """Rename staging to out; an old out is moved aside first and deleted afterwards."""
    if not out.exists():
        os.rename(staging, out)
        return
    trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rename(out, trash / "old")
    os.rename(staging, out)
    shutil.rmtree(trash, ignore_errors=True)


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
