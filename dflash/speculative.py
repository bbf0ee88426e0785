"""Greedy decoding, plain and speculative (DFlash), batch size 1, with KV caches on both sides.

One speculative cycle, with n committed tokens whose last one (the bonus, position a = n-1)
has no target features yet:
  drafter: block [x_a, MASK x (B-1)] at positions a..a+B-1 over its cached context (< a)
  target:  verifies [x_a, d_1..d_{B-1}] in one forward; accepts the longest prefix with
           d_i == target's choice, plus the target's own next token (the new bonus)
  both caches keep only committed positions; the drafter's context grows by the target
  features of the accepted tokens (anchor included).
The output equals plain greedy decoding token for token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from dflash.model import DFlashDrafter, DrafterCache
from dflash.target import FrozenTarget


@dataclass
class DecodeResult:
    tokens: list[int]  # generated tokens, prompt excluded
    seconds: float
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per verify cycle

    @property
    def target_forwards(self) -> int:
        return len(self.accepted)


def _new_cache(target: FrozenTarget):
    """A cache whose every layer keeps all positions, so it can be cropped after a rejected
    draft. Given the model config, transformers would build sliding-window layers for targets
    that have them (Mistral, Gemma 2/3), and those cannot be cropped; attention masks still
    apply the window, since they come from the config, not from the cache."""
    return DynamicCache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _finish(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    tokens = tokens[:max_new_tokens]
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens


@torch.no_grad()
def greedy_decode(target: FrozenTarget, prompt: list[int], max_new_tokens: int, eos_ids: set[int]) -> DecodeResult:
    device = target.device
    _sync(device)
    start = time.perf_counter()
    cache = _new_cache(target)
    out = target.decode_step(torch.tensor([prompt], device=device), cache)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < max_new_tokens and tokens[-1] not in eos_ids:
        out = target.decode_step(torch.tensor([[tokens[-1]]], device=device), cache)
        tokens.append(int(out.logits[0, -1].argmax()))
    _sync(device)
    return DecodeResult(tokens=_finish(tokens, max_new_tokens, eos_ids), seconds=time.perf_counter() - start)


def propose_block(
    target: FrozenTarget, drafter: DFlashDrafter, context: DrafterCache, last_token: int, anchor: int
) -> torch.Tensor:
    """The drafter's B-1 greedy guesses for positions anchor+1.. in ONE forward."""
    device, block = target.device, drafter.block_size
    block_ids = torch.full((1, block), drafter.mask_token_id, device=device)
    block_ids[0, 0] = last_token
    positions = torch.arange(anchor, anchor + block, device=device)[None]
    hidden = drafter.draft(context, target.embed_tokens(block_ids), positions)
    return target.lm_head(hidden[0, 1:]).argmax(-1)


@torch.no_grad()
def speculative_decode(
    target: FrozenTarget, drafter: DFlashDrafter, prompt: list[int], max_new_tokens: int, eos_ids: set[int]
) -> DecodeResult:
    device, block = target.device, drafter.block_size
    _sync(device)
    start = time.perf_counter()
    cache, context = _new_cache(target), DrafterCache()
    out = target.decode_step(torch.tensor([prompt], device=device), cache)
    drafter.extend_context(context, out.features, torch.arange(len(prompt), device=device)[None])
    tokens = [int(out.logits[0, -1].argmax())]
    accepted: list[int] = []
    while len(tokens) < max_new_tokens and not eos_ids.intersection(tokens):
        anchor = len(prompt) + len(tokens) - 1
        positions = torch.arange(anchor, anchor + block, device=device)[None]
        draft = propose_block(target, drafter, context, tokens[-1], anchor)
        verify_ids = torch.cat([draft.new_tensor([tokens[-1]]), draft])[None]
        out = target.decode_step(verify_ids, cache)
        choice = out.logits[0].argmax(-1)  # choice[i]: target's token for position anchor+i+1
        matches = (draft == choice[:-1]).long().cumprod(0)
        k = int(matches.sum())
        tokens.extend(draft[:k].tolist() + [int(choice[k])])
        accepted.append(k)
        FrozenTarget.crop_cache(cache, anchor + k + 1)
        drafter.extend_context(context, out.features[:, : k + 1], positions[:, : k + 1])
    _sync(device)
    return DecodeResult(
        tokens=_finish(tokens, max_new_tokens, eos_ids), seconds=time.perf_counter() - start, accepted=accepted
    )
