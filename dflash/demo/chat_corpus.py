"""The chat corpus of the demo target: conversations from chat JSONL files (the demo's are
edit_tasks.py's), split into train and held out by a hash of the conversation, and turned into
padded batches for one pass.

A target trained on many conversations once answers from its prompt, so a drafter has to read
the context, which is what it does on a real target; a target that memorised a small corpus
answers from its weights instead.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from pathlib import Path

import torch

from dflash.data.chat_formats import SampleError, load_chat_jsonl
from dflash.data.tokenization import tokenize_conversation

# One conversation in this many is held out (for the target's held-out loss).
HELDOUT_MODULUS = 50
# Samples drawn at once and sorted by length, so that batches need little padding.
BUCKET_BATCHES = 8
IGNORE_INDEX = -100


def conversation_key(messages: list[dict]) -> bytes:
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).digest()


def is_heldout(messages: list[dict]) -> bool:
    """The split depends on the conversation alone, not on the file order."""
    return conversation_key(messages)[0] % HELDOUT_MODULUS == 0


def load_conversations(paths: list[Path]) -> tuple[list[list[dict]], list[list[dict]]]:
    """(train, held out) conversations of every file, in file order."""
    train, heldout = [], []
    for path in paths:
        for messages in load_chat_jsonl(path):
            (heldout if is_heldout(messages) else train).append(messages)
    return train, heldout


def conversation_texts(conversations: list[list[dict]]) -> Iterator[str]:
    """Every message's text, for the tokenizer trainer."""
    for messages in conversations:
        for message in messages:
            yield message["content"]


def encode(tokenizer, messages: list[dict], max_length: int) -> tuple[list[int], list[int]] | None:
    """Token ids and labels (every assistant turn supervised, the rest IGNORE_INDEX), cut to
    max_length; None for a conversation the template cannot split into turns."""
    try:
        ids, mask = tokenize_conversation(tokenizer, messages, loss_turns="all")
    except SampleError:
        return None
    ids, mask = ids[:max_length].tolist(), mask[:max_length].tolist()
    if not any(mask):
        return None
    return ids, [token if trained else IGNORE_INDEX for token, trained in zip(ids, mask)]


def encode_all(tokenizer, conversations: list[list[dict]], max_length: int) -> list[tuple[list[int], list[int]]]:
    return [sample for sample in (encode(tokenizer, m, max_length) for m in conversations) if sample is not None]


def collate(group: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask and labels."""
    width = max(len(ids) for ids, _ in group)
    input_ids = torch.full((len(group), width), pad_id, dtype=torch.long)
    labels = torch.full((len(group), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(group), width), dtype=torch.long)
    for row, (ids, row_labels) in enumerate(group):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(ids)] = torch.tensor(row_labels)
        attention_mask[row, : len(ids)] = 1
    return input_ids, attention_mask, labels


def one_pass(lengths: list[int], batch_size: int, seed: int) -> list[list[int]]:
    """Every sample index once, shuffled by the seed, grouped into batches of similar lengths."""
    order = list(range(len(lengths)))
    rng = random.Random(seed)
    rng.shuffle(order)
    groups = []
    pool_size = batch_size * BUCKET_BATCHES
    for start in range(0, len(order), pool_size):
        pool = sorted(order[start:start + pool_size], key=lambda i: lengths[i])
        batches = [pool[i:i + batch_size] for i in range(0, len(pool), batch_size)]
        rng.shuffle(batches)
        groups.extend(batches)
    return groups


def padded_batches(samples: list, groups: list[list[int]], pad_id: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """The padded batches of `groups`, made as they are consumed."""
    for group in groups:
        yield collate([samples[i] for i in group], pad_id)


@torch.no_grad()
def mean_loss(model, samples: list, batch_size: int, pad_id: int) -> float:
    """Mean loss per supervised token over `samples`."""
    device = next(model.parameters()).device
    total, tokens = 0.0, 0
    for batch in padded_batches(samples, one_pass([len(ids) for ids, _ in samples], batch_size, seed=0), pad_id):
        input_ids, attention_mask, labels = (t.to(device) for t in batch)
        count = int((labels[:, 1:] != IGNORE_INDEX).sum())
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        total, tokens = total + float(loss) * count, tokens + count
    return total / max(tokens, 1)
