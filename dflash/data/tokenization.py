"""Tokenizers and the chat template: token ids plus the loss mask on assistant tokens.

  load_tokenizer         a tokenizer folder (or a GGUF file's tokenizer) with a chat template
  tokenize_conversation  chat-template token ids + loss mask on the assistant span(s)
  prompt_ids             the prompt up to the final reply, with the generation prompt
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import numpy as np

from dflash.data.chat_formats import DataError, Messages, SampleError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# Content beyond max_length x this many characters cannot reach the first max_length tokens
# (no tokenizer we know has longer tokens), so it is cut before tokenizing: a 14 MB line
# then costs what a max_length one does.
MAX_CHARS_PER_TOKEN = 64

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
    require_chat_template(tokenizer)
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

    from dflash.target.gguf import from_pretrained_args  # imports transformers too

    name, kwargs = from_pretrained_args(name_or_path)
    if not kwargs and Path(name).is_dir() and not any((Path(name) / f).exists() for f in TOKENIZER_FILES):
        raise DataError(f"--tokenizer {name_or_path} (default: --target): the folder holds no tokenizer files "
                        f"({', '.join(TOKENIZER_FILES)}); copy the model's tokenizer into it, or pass --tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as err:
        raise DataError(f"--tokenizer {name_or_path}: cannot load a tokenizer ({err}); pass a "
                        "folder with tokenizer files and a chat template, or a GGUF file") from err
    require_chat_template(tokenizer)
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
    require_chat_template(tokenizer)
    return _render_ids(tokenizer, prompt_messages(messages), add_generation_prompt=True, **template_kwargs)


def require_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
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
