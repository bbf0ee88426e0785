"""A tiny byte-level BPE tokenizer with a ChatML template, built in memory for tests.

Nothing is read from disk or a hub: the vocabulary is the 256 byte symbols, three
special tokens and a handful of hand-written merges, so it is deterministic and
builds in a few milliseconds. Byte-level means any text round-trips exactly.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)

# Jinja string literals understand "\n", so the template text keeps the escape.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Qwen3's template in small: an enable_thinking switch whose "off" writes an empty think block
# after the generation prompt (the default is on), the replies after the last user turn rendered
# with their think block (empty when they have none), earlier replies without it: so a
# conversation with two replies renders its first one otherwise once the second follows.
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- set content = message['content'] -%}"
    "{%- set answer = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- set think = content.split('</think>')[0].split('<think>')[-1].strip('\\n') if '</think>' in content else '' -%}"
    "{%- if loop.index0 > ns.last_query -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + think + '\\n</think>\\n\\n' + answer + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>assistant\\n' + answer + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

# Words that get whole-word tokens, so tokenized text is not just bytes.
# A leading "Ġ" is the byte-level symbol for a space.
_MERGED_WORDS = (
    "system", "user", "assistant", "Hello", "Hi", "What", "The",
    "Ġthe", "Ġa", "Ġis", "Ġof", "Ġand", "Ġto", "Ġyou", "Ġare", "Ġhow",
    "Ġcat", "Ġdog", "Ġsat", "Ġon", "Ġmat", "Ġtoday", "Ġhelp", "Ġthere",
)


def _byte_vocab_and_merges(words: tuple[str, ...]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Specials first, then the byte alphabet, then left-to-right merges of each word."""
    vocab: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *sorted(pre_tokenizers.ByteLevel.alphabet())):
        vocab.setdefault(token, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in words:
        for end in range(2, len(word) + 1):
            left, right, merged = word[: end - 1], word[end - 1], word[:end]
            if merged not in vocab:
                vocab[merged] = len(vocab)
                merges.append((left, right))
    return vocab, merges


def make_tiny_tokenizer(chat_template: bool = True, words: tuple[str, ...] = _MERGED_WORDS) -> PreTrainedTokenizerFast:
    """Return a fresh tiny tokenizer; `chat_template=False` leaves the template unset. Other `words`
    (the same ones reordered, say) give another model's tokenizer of the same kind."""
    vocab, merges = _byte_vocab_and_merges(words)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
    )
    if chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def make_thinking_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny tokenizer with THINKING_TEMPLATE."""
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer
