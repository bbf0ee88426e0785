"""Tokenizers and the chat template: token ids plus the loss mask on assistant tokens.

  load_tokenizer         a tokenizer folder (or a GGUF file's tokenizer) with a chat template
  conversation_sequences the sequence(s) one conversation trains on
  tokenize_conversation  chat-template token ids + loss mask on the assistant span(s)
  prompt_ids             the prompt up to the final reply, with the generation prompt
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import numpy as np

from dflash.data.chat_formats import DataError, Messages, SampleError, TargetReply
from dflash.data.thinking import thinking_kwargs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# Content beyond max_length x this many characters cannot reach the first max_length tokens
# (no tokenizer we know has longer tokens), so it is cut before tokenizing: a 14 MB line
# then costs what a max_length one does.
MAX_CHARS_PER_TOKEN = 64

LOSS_TURNS = ("last", "all")
NOT_PREFIX_STABLE = "template not prefix-stable"

TokenSequence = tuple[np.ndarray, np.ndarray]  # token ids int32, loss mask bool


def conversation_sequences(
    tokenizer: PreTrainedTokenizerBase, messages: Messages, reply: TargetReply | None = None,
    max_chars: int | None = None, loss_turns: str = "last", thinking: str = "none",
) -> list[TokenSequence]:
    """The sequences a conversation trains on (see tokenize_conversation): one, or with
    `loss_turns="all"` and a template that renders an earlier reply otherwise once later turns
    follow (Qwen3's drops its thinking), one per assistant turn, each as serving renders it: the
    conversation up to the turn with the generation prompt, then the turn."""
    try:
        return [tokenize_conversation(tokenizer, messages, max_chars, loss_turns, thinking, reply)]
    except SampleError as err:
        if loss_turns != "all" or err.reason != NOT_PREFIX_STABLE:
            raise
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return [tokenize_conversation(tokenizer, messages[: turn + 1], max_chars, "last", thinking,
                                  reply if turn == turns[-1] else None) for turn in turns]


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: Messages, max_chars: int | None = None, loss_turns: str = "last",
    thinking: str = "none", reply: TargetReply | None = None,
) -> TokenSequence:
    """Return (token ids int32, loss mask bool) of a conversation rendered by the chat template
    (in the resolved `thinking` mode, dflash/data/thinking.py).

    The mask is True on what the last assistant turn produces (`loss_turns="all"`: every
    assistant turn): its content, the tool calls the template renders in it, and its end-of-turn
    token, never the role header. The last is the default because regeneration replaces only the
    final reply: earlier replies of a multi-turn prompt are the dataset's text, which the target
    never wrote. A turn's characters are found by rendering the conversation
    up to the turn with a generation prompt (span start) and including the turn (span end),
    both of which must be TEXT prefixes of the full render; the full render is tokenized once,
    and the tokens overlapping those characters are the turn's. Contents longer than
    `max_chars` are cut first (see MAX_CHARS_PER_TOKEN).

    The final reply as the target wrote it (`reply`, from regeneration): its emitted token ids
    follow the prompt's ids (prompt_ids) as they are, since tokenizing its text again can merge
    differently; a reply cut at the length limit without ids is the prompt's text followed by the
    reply's, never closed by the template's end-of-turn token.
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
    template = thinking_kwargs(thinking)
    final = replies[-1]
    emitted = _emitted_ids(tokenizer, reply)
    cut_text = emitted is None and reply is not None and reply.cut
    if emitted is not None or cut_text:  # the final reply is not the template's to render
        prompt = _render_text(tokenizer, messages[:final], add_generation_prompt=True, **template)
        text, whole = prompt, "the final reply's prompt"
        if cut_text:
            text += messages[final]["content"]
            _check_tool_calls_rendered(messages[final], messages[final]["content"], final)
        templated = replies[:-1] if loss_turns == "all" else []
    else:
        text = _render_text(tokenizer, messages, add_generation_prompt=False, **template)
        whole = "the whole conversation"
        templated = replies if loss_turns == "all" else replies[-1:]
    encoded = _encode_with_offsets(tokenizer, text)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    mask = _templated_turns_mask(tokenizer, messages, templated, template, text, whole, ids, offsets)
    if cut_text:  # the tokens of the reply's characters, and no end-of-turn token after them
        mask[_token_span(offsets, len(prompt), len(text))[0]:] = True
    if emitted is not None:
        return (np.asarray(ids + emitted, dtype=np.int32),
                np.concatenate([mask, np.ones(len(emitted), dtype=bool)]))
    return np.asarray(ids, dtype=np.int32), mask


def _templated_turns_mask(tokenizer: PreTrainedTokenizerBase, messages: Messages, turns: list[int],
                          template: dict, text: str, whole: str, ids: list[int], offsets) -> np.ndarray:
    """True on the tokens of the assistant `turns` that the template renders within `text` (their
    content and end-of-turn token, not the role header); each turn's render must be a text prefix."""
    mask = np.zeros(len(ids), dtype=bool)
    for turn in turns:
        start = _render_text(tokenizer, messages[:turn], add_generation_prompt=True, **template)
        end = _render_text(tokenizer, messages[: turn + 1], add_generation_prompt=False, **template)
        _check_text_prefix(start, end, turn, "the generation prompt", "the turn")
        _check_text_prefix(end, text, turn, "the turn", whole)
        _check_tool_calls_rendered(messages[turn], end[len(start):], turn)
        first, last = _token_span(offsets, len(start), len(end))
        mask[first:_reply_end(tokenizer, ids, first, last)] = True
    return mask


def _emitted_ids(tokenizer: PreTrainedTokenizerBase, reply: TargetReply | None) -> list[int] | None:
    """The ids the target emitted for the final reply, checked against the tokenizer, or None."""
    if reply is None or reply.token_ids is None:
        return None
    outside = [i for i in reply.token_ids if i >= len(tokenizer)]
    if outside:
        raise SampleError(f"target_reply.token_ids: id {outside[0]} is outside the {len(tokenizer)} ids of tokenizer "
                          f"{tokenizer.name_or_path!r}; the reply was generated with another tokenizer: pass the "
                          "--tokenizer of the target that regenerated the data", "token id out of range")
    return list(reply.token_ids)


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
    return many_prompt_ids(tokenizer, [messages], **template_kwargs)[0]


def many_prompt_ids(tokenizer: PreTrainedTokenizerBase, conversations: list[Messages],
                    **template_kwargs) -> list[list[int]]:
    """prompt_ids of each conversation, tokenized in one batch call: a fast tokenizer spreads a
    batch over the cores, where one call per prompt runs on one (27K regeneration prompts: seconds,
    not a minute)."""
    require_chat_template(tokenizer)
    texts = [_render_text(tokenizer, prompt_messages(m), True, **template_kwargs) for m in conversations]
    # The template already writes any BOS; add_special_tokens would duplicate it.
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []


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
                          "renders earlier turns unchanged", NOT_PREFIX_STABLE)


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
