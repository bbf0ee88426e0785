"""Chat records (OpenAI `messages`, ShareGPT `conversations`, `prompt`/`response`) -> template messages.

Every format reaches the template as OpenAI-style dicts: `role` (ShareGPT's human/gpt become
user/assistant), `content` a string (text parts joined with a newline), and where given the
assistant's `tool_calls` ({"type": "function", "function": {"name", "arguments": dict}}, the
form Hugging Face templates read) and a tool reply's `tool_call_id` / `name`. Other keys are
ignored. Errors name the file:line and the turn.

load_chat_jsonl reads a JSONL file of such records (gzip too), each line validated with
file:line errors (prompt-only ones too, for regeneration and evaluation: require_reply=False).
parse_sample also reads what `python -m dflash.regenerate` recorded about the final reply
(`target_reply`: the token ids the target emitted, why it stopped, the thinking mode), which
training uses in place of the reply's text.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Messages = list[dict[str, Any]]

ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"human": "user", "gpt": "assistant"}  # ShareGPT's speakers, accepted in either list
TURN_LISTS = ("messages", "conversations")  # OpenAI, ShareGPT
# vLLM joins a message's text parts with a newline for templates that take string content
# (those of text models), so that is how the target saw them.
TEXT_PART_SEPARATOR = "\n"
FINISH_REASONS = ("stop", "length")  # the stop token was emitted | cut at --max-new-tokens
THINKING_MODES = ("on", "off", "none")  # "none": the chat template has no thinking switch


class DataError(ValueError):
    """Bad input data or settings; the message says what, where and what to do."""


class SampleError(DataError):
    """One bad sample (line): skipped and counted under --on-bad-sample skip."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason  # a short category, for the counts

    def __reduce__(self):  # travels back from tokenizer worker processes
        return SampleError, (str(self), self.reason)


def parse_record(record: Any, where: str, require_reply: bool = True) -> Messages:
    """One JSON record -> messages; raises SampleError naming `where`. Training needs an
    assistant reply in each; prompts (require_reply=False) may end in a user turn or be
    `{"prompt": ...}` alone, since only what precedes the final reply is used."""
    if not isinstance(record, dict):
        raise SampleError(f"{where}: expected a JSON object, got {type(record).__name__}", "not a conversation")
    forms = [key for key in TURN_LISTS if key in record]
    if "prompt" in record or "response" in record:
        forms.append("prompt")
    if len(forms) != 1:
        raise SampleError(f"{where}: expected exactly one of a 'messages' list (OpenAI), a 'conversations' list "
                          f"(ShareGPT) or 'prompt' and 'response' strings, got keys {sorted(record)}",
                          "not a conversation")
    if forms[0] == "prompt":
        messages = _prompt_response(record, where, require_reply)
    else:
        messages = _parse_turns(record[forms[0]], forms[0], where)
    if require_reply:
        _check_assistant_replies(messages, where)
    else:
        _check_prompt(messages, where)
    return messages


def _prompt_response(record: dict, where: str, require_reply: bool) -> Messages:
    messages = [{"role": "user", "content": _string_field(record, "prompt", where)}]
    if require_reply or "response" in record:
        messages.append({"role": "assistant", "content": _string_field(record, "response", where)})
    return messages


def _string_field(record: dict, key: str, where: str) -> str:
    """Return record[key], which must be a string."""
    value = record.get(key)
    if not isinstance(value, str):
        raise SampleError(f"{where}: '{key}' must be a string, got {type(value).__name__}", "wrong type")
    return value


def _parse_turns(raw: Any, key: str, where: str) -> Messages:
    if not isinstance(raw, list) or not raw:
        raise SampleError(f"{where}: '{key}' must be a non-empty list of {{'role': ..., 'content': ...}} "
                          "(or ShareGPT {'from': ..., 'value': ...}) objects", "empty conversation")
    return [_parse_turn(turn, f"{where}: {key}[{i}]") for i, turn in enumerate(raw)]


def _parse_turn(turn: Any, where: str) -> dict[str, Any]:
    """One OpenAI {'role', 'content', ...} or ShareGPT {'from', 'value'} turn as a message."""
    if not isinstance(turn, dict):
        raise SampleError(f"{where} must be an object, got {type(turn).__name__}", "wrong type")
    role_key, content_key = ("from", "value") if "from" in turn and "role" not in turn else ("role", "content")
    speaker = _string_field(turn, role_key, where)
    role = ROLE_ALIASES.get(speaker, speaker)
    if role not in ROLES:
        raise SampleError(f"{where}: unknown role {speaker!r}; expected one of {[*ROLES, *ROLE_ALIASES]}",
                          "unknown role")
    tool_calls = _tool_calls(turn.get("tool_calls"), role, where)
    message: dict[str, Any] = {"role": role, "content": _content(turn.get(content_key), content_key,
                                                                 bool(tool_calls), where)}
    if tool_calls:
        message["tool_calls"] = tool_calls
    if role == "tool":  # which call it answers: templates such as Mistral's render the id
        message.update({key: _string_field(turn, key, where) for key in ("tool_call_id", "name")
                        if turn.get(key) is not None})
    return message


def _content(value: Any, key: str, beside_tool_calls: bool, where: str) -> str:
    """A turn's text: a string or OpenAI text parts. OpenAI writes content null on an assistant
    turn that only calls tools; it becomes "" since templates concatenate content."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return TEXT_PART_SEPARATOR.join(_text_part(part, f"{where}.{key}[{i}]") for i, part in enumerate(value))
    if value is None and beside_tool_calls:
        return ""
    if value is None:
        raise SampleError(f"{where}: '{key}' is null or missing; only an assistant turn with tool_calls may have "
                          "no content: fill it in or remove the line", "wrong type")
    raise SampleError(f"{where}: '{key}' must be a string or a list of text parts, got {type(value).__name__}",
                      "wrong type")


def _text_part(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if isinstance(kind, str) and kind != "text":
        noun = kind.removeprefix("input_").removesuffix("_url")  # image_url -> image, input_audio -> audio
        raise SampleError(f"{where}: {noun} parts are not supported: the drafter trains on text; drop the {noun} "
                          "or the sample", "non-text content")
    raise SampleError(f"{where} must be a {{'type': 'text', 'text': ...}} object", "wrong type")


def _tool_calls(value: Any, role: str, where: str) -> list[dict[str, Any]]:
    """The turn's tool calls in the form chat templates read (absent, null and [] are none)."""
    if not value:
        return []
    if role != "assistant":
        raise SampleError(f"{where}: a {role} turn has tool_calls; only assistant turns call tools", "bad tool call")
    if not isinstance(value, list):
        raise SampleError(f"{where}: 'tool_calls' must be a list, got {type(value).__name__}", "bad tool call")
    return [_tool_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(value)]


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or call.get("type", "function") != "function":
        raise SampleError(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}",
                          "bad tool call")
    call_id = {"id": call["id"]} if isinstance(call.get("id"), str) else {}
    return {**call_id, "type": "function",
            "function": {"name": function["name"], "arguments": _arguments(function.get("arguments"), where)}}


def _arguments(value: Any, where: str) -> dict[str, Any]:
    """A call's arguments as a dict: OpenAI writes a JSON string, but templates apply `tojson` to
    them (a string would render quoted), so they are decoded as vLLM does before rendering."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return {}  # a call without arguments
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise SampleError(f"{where}.function.arguments is not valid JSON ({err.msg} at column {err.colno}); "
                              "write them as a JSON object", "bad tool call") from err
    if not isinstance(value, dict):
        raise SampleError(f"{where}.function.arguments must be a JSON object, got {type(value).__name__}",
                          "bad tool call")
    return value


def _check_assistant_replies(messages: Messages, where: str) -> None:
    """A conversation must train on something: at least one non-empty assistant turn."""
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not replies:
        raise SampleError(f"{where}: conversation has no assistant turn, so nothing to train on; add an "
                          "assistant reply (python -m dflash.regenerate writes the target's) or remove the line",
                          "no assistant turn")
    for turn in replies:
        if not messages[turn]["content"].strip() and "tool_calls" not in messages[turn]:
            raise SampleError(f"{where}: assistant turn {turn} (counting from 0) has empty content and no tool "
                              "calls; fill it in or remove the line", "empty assistant turn")


def _check_prompt(messages: Messages, where: str) -> None:
    """A prompt needs a turn before its final reply for the model to answer (see prompt_messages)."""
    if all(m["role"] == "assistant" for m in messages):
        raise SampleError(f"{where}: conversation has only assistant turns, so no prompt to answer; "
                          "add a user turn or remove the line", "no prompt")


GZIP_MAGIC = b"\x1f\x8b"


def load_chat_jsonl(path: str | Path, require_reply: bool = True) -> list[Messages]:
    """Read every conversation of a chat JSONL file (plain or gzip) as a list of messages (the
    formats: dflash/data/chat_formats.py); the first bad line raises a DataError naming it. Training
    needs an assistant reply in each; prompts (regeneration, evaluation: require_reply=False) may
    end in a user turn or be `{"prompt": ...}` alone, since only what precedes the final reply is used."""
    path = Path(path)
    return [parse_line(raw, f"{path}:{lineno}", require_reply) for lineno, raw in iter_lines(path)]


def iter_lines(path: Path) -> Iterator[tuple[int, bytes]]:
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


@dataclass(frozen=True)
class TargetReply:
    """What regeneration recorded about a record's final reply; a field it did not record is None.

    token_ids: exactly the ids the target emitted, its stop token included when finish_reason is
    "stop"; thinking: the mode its prompt was rendered in (THINKING_MODES)."""

    token_ids: list[int] | None = None
    finish_reason: str | None = None
    thinking: str | None = None

    @property
    def cut(self) -> bool:
        """Cut at the length limit: the target had not finished, so no end-of-turn follows."""
        return self.finish_reason == "length"


def parse_sample(raw: bytes, where: str) -> tuple[Messages, TargetReply | None]:
    """One training line -> (messages, its `target_reply` or None); raises SampleError naming `where`."""
    record = _parse_json(_decode_line(raw, where), where)
    messages = parse_record(record, where)
    return messages, _target_reply(record.get("target_reply"), f"{where}: target_reply")


def _target_reply(value: Any, where: str) -> TargetReply | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise SampleError(f"{where} must be an object, got {type(value).__name__}", "bad target_reply")
    ids, reason, thinking = (value.get(key) for key in ("token_ids", "finish_reason", "thinking"))
    if ids is not None and (not isinstance(ids, list) or not ids
                            or not all(type(i) is int and i >= 0 for i in ids)):
        raise SampleError(f"{where}.token_ids must be a non-empty list of token ids (integers >= 0)",
                          "bad target_reply")
    if reason is not None and reason not in FINISH_REASONS:
        raise SampleError(f"{where}.finish_reason {reason!r}: expected one of {list(FINISH_REASONS)}",
                          "bad target_reply")
    if thinking is not None and thinking not in THINKING_MODES:
        raise SampleError(f"{where}.thinking {thinking!r}: expected one of {list(THINKING_MODES)}",
                          "bad target_reply")
    return TargetReply(ids, reason, thinking)


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
