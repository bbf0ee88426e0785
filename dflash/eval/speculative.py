"""Greedy decoding, plain and speculative (DFlash), batch size 1, with KV caches on both sides.

One speculative cycle, with n committed tokens whose last one (the bonus, position a = n-1)
has no target features yet:
  drafter: block [x_a, MASK x (B-1)] at positions a..a+B-1 over its cached context (< a)
  target:  verifies [x_a, d_1..d_{B-1}] in one forward; accepts the longest prefix with
           d_i == target's choice, plus the target's own next token (the new bonus)
  both caches keep only committed positions in view; the drafter's context gains the target
  features of the verified block (the accepted ones, anchor included, are those it will see).
The output equals plain greedy decoding token for token.

Two target paths share this loop: `plain` runs HF's own forward over a DynamicCache (any
family, cropped after a rejected draft); `fast` runs dflash.target.static (static caches, and
CUDA graphs on a GPU) for the families it knows. The drafter always decodes over a static cache,
and on the fast path its steps are compiled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from dflash.drafter.model import DFlashDrafter, DrafterCache, StackedProjections
from dflash.drafter.vocab import DraftHead
from dflash.target.frozen import FrozenTarget
from dflash.target.graphs import GraphReplays
from dflash.target.static import StaticTarget, fast_decoding_supported, round_up
from dflash.util.runtime import HostCopy, allow_compiled_variants, synchronize

DECODERS = ("auto", "fast", "plain")
# Greedy decoding reads its tokens back every this many steps, to see an end of sequence: a read
# every token makes the host wait for the GPU, which then idles while the host queues the next
# step (SmolLM2-135M: 1.95 ms a token, against 1.56 for the step alone). The steps past the end
# (at most this many - 1) are cut from the reply.
EOS_CHECK_EVERY = 8


@dataclass
class DecodeResult:
    tokens: list[int]  # generated tokens, prompt excluded
    seconds: float
    # per verify cycle: the tokens it added, less the target's own one (its accepted drafts); the
    # last cycle's tokens past the end of sequence or max_new_tokens are not counted
    accepted: list[int] = field(default_factory=list)
    # of `seconds`, the prompt's share: the target's prefill (speculative: and the drafter's
    # context and first proposal), so that a step or a cycle can be timed without it
    prefill_seconds: float = 0.0

    @property
    def target_forwards(self) -> int:
        return len(self.accepted)


def _finish(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    tokens = tokens[:max_new_tokens]
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens


class PlainTargetSession:
    """HF's forward over a DynamicCache: every family transformers runs. The cache keeps every
    position (no sliding-window layers, which cannot be cropped); masks still apply the window,
    since they come from the config."""

    def __init__(self, target: FrozenTarget):
        self.target = target
        self.cache = DynamicCache()

    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A prompt [1, P] -> (target's choice after it [1, 1], features [1, P, K*D])."""
        self.cache = DynamicCache()
        choice, features = self.step(ids, 0)
        return choice[:, -1:], features

    def step(self, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [1, T] at positions start.. -> (target's choice after each [1, T], features [1, T, K*D])."""
        FrozenTarget.crop_cache(self.cache, start)
        out = self.target.decode_step(ids, self.cache)
        return out.logits.argmax(-1), out.features


class DraftSession:
    """The drafter's side: its context cache, and its two steps, each replayed as a CUDA graph
    when `graphed`: `start` proposes a prompt's first block; `advance` takes a verified block's
    target features and choices, works out on the device which drafts were accepted, and proposes
    the next block from there, so that it is queued before the host has read the acceptance."""

    def __init__(self, target: FrozenTarget, drafter: DFlashDrafter, capacity: int, graphed: bool,
                 compiled: bool = True):
        device, dtype = target.device, target.embed_tokens.weight.dtype
        self.target, self.drafter = target, drafter
        self.head = DraftHead.of(drafter, target.lm_head)
        block = drafter.block_size
        # A block proposed after the last verify reaches up to B columns past the decoder's
        # capacity (it is queued before the host knows decoding ends). Aligned mask rows let SDPA
        # take its fused kernels (as in the target's StaticTarget).
        self.cache = DrafterCache.allocate(drafter.config, 1, round_up(capacity + block, 16), device, dtype)
        self.stacked = StackedProjections.of(drafter)  # fewer kernels a step; the drafter's weights as of now
        self.graphs = GraphReplays(device, graphed)
        # Where the steps replay as CUDA graphs they are compiled first: at batch 1 a step is bound
        # by its kernel count, and Inductor fuses each layer's norms, RoPE, mask and elementwise
        # work into a few kernels (BENCHMARKS "Real target": the proposal's cost, compiled or not).
        # Fixed shapes: one Decoder's steps never change shape (each Decoder, e.g. one per drafter
        # judged in one process, adds a variant).
        compiled = compiled and self.graphs.enabled
        if compiled:
            allow_compiled_variants()
        compile_step = (lambda step: torch.compile(step, dynamic=False)) if compiled else (lambda step: step)
        self._start_step, self._advance_step = compile_step(self._propose), compile_step(self._advance)
        self._block_ids = torch.full((1, block), drafter.mask_token_id, device=device)
        self._offsets = torch.arange(block, device=device)[None]
        self._anchor = torch.zeros((), dtype=torch.long, device=device)  # of the block to propose
        self.proposal = torch.zeros((1, block), dtype=torch.long, device=device)  # [anchor token, B-1 drafts]
        # what `advance` reads: the verified block's anchor, drafts and choices, and features
        self._verified_at = torch.zeros((), dtype=torch.long, device=device)
        self._outcome = torch.zeros(2 * block - 1, dtype=torch.long, device=device)
        self._features = torch.zeros(1, block, target.hidden_size * len(target.layer_ids), device=device,
                                     dtype=dtype)

    def extend(self, features: torch.Tensor, start: int) -> None:
        """Features [1, T, K*D] of positions start..start+T-1 (a prompt's) into the drafter's context."""
        positions = torch.arange(start, start + features.shape[1], device=features.device)[None]
        self.drafter.extend_context(self.cache, features, positions, self.stacked)

    def start(self, token: torch.Tensor, anchor: int) -> torch.Tensor:
        """The block anchored at `anchor` on `token` [1] (a device tensor): `proposal` [1, B],
        the token and the drafter's B-1 greedy guesses for positions anchor+1.., in ONE forward."""
        self._block_ids[0, :1] = token
        self._anchor.fill_(anchor)
        self.graphs("start", self._start_step)
        return self.proposal

    def advance(self, outcome: torch.Tensor, features: torch.Tensor, anchor: int) -> torch.Tensor:
        """After the target verified `proposal` at `anchor`, given `outcome` [2B-1] (the block's
        B-1 drafts, then the target's choice after each of its B tokens) and their features
        [1, B, K*D]: the next `proposal`, anchored at the target's choice after the accepted
        drafts. All on the device: the host reads the acceptance meanwhile."""
        self._outcome.copy_(outcome)
        self._features.copy_(features)
        self._verified_at.fill_(anchor)
        self.graphs("advance", self._advance_step)
        return self.proposal

    def _advance(self) -> None:
        # Reads only what `advance` filled in, so that running it twice writes the same (a CUDA
        # graph's capture runs it three times). Every verified position joins the context; those
        # past the accepted ones stay out of the view of every later draft and are rewritten
        # before they come into it.
        block = self.drafter.block_size
        self.drafter.extend_context(self.cache, self._features, self._verified_at + self._offsets, self.stacked)
        drafts, choices = self._outcome[: block - 1], self._outcome[block - 1:]
        accepted = (drafts == choices[:-1]).long().cumprod(0).sum()
        self._block_ids[0, :1] = choices.index_select(0, accepted[None])  # the bonus token
        self._anchor.copy_(self._verified_at + accepted + 1)
        self._propose()

    def _propose(self) -> None:
        self.proposal[0, :1] = self._block_ids[0, :1]
        self.proposal[0, 1:] = self._guess()

    def _guess(self) -> torch.Tensor:
        """The drafter's B-1 greedy guesses [B-1] for the block in `_block_ids` at `_anchor`."""
        hidden = self.drafter.draft(self.cache, self.target.embed_tokens(self._block_ids), self._anchor + self._offsets,
                                    self.stacked)
        return self.head.to_target(self.head(hidden[0, 1:]).argmax(-1))


def resolve_decoder(name: str, target: FrozenTarget) -> str:
    """`auto`: fast for the families dflash.target.static runs, plain for the rest."""
    if name not in DECODERS:
        raise ValueError(f"--decoder {name}: use one of {', '.join(DECODERS)}")
    if name == "auto":
        return "fast" if fast_decoding_supported(target) else "plain"
    return name


class Decoder:
    """Greedy and speculative decoding of one target (and drafter), reused across prompts:
    caches and CUDA graphs are made once, for sequences of up to `capacity` positions."""

    def __init__(self, target: FrozenTarget, drafter: DFlashDrafter | None, capacity: int, kind: str = "plain",
                 compile_drafter: bool = True, compile_target: bool = True):
        self.target, self.drafter, self.capacity = target, drafter, capacity
        fast = resolve_decoder(kind, target) == "fast"
        # a StaticTarget at batch 1 needs no reset: a new prompt overwrites its cache
        self.session = StaticTarget(target, 1, capacity, compiled=compile_target) if fast \
            else PlainTargetSession(target)
        self.draft = DraftSession(target, drafter, capacity, graphed=fast, compiled=compile_drafter) \
            if drafter is not None else None
        self.acceptance = HostCopy(target.device)

    def _ready(self, prompt: list[int], room: int, tokens: int) -> None:
        """Check that the prompt and `room` more fit, and capture the graphs its decoding will
        replay (its prefill, steps of `tokens` tokens): one-off costs, kept off the clock."""
        if len(prompt) + room > self.capacity:
            raise ValueError(f"a prompt of {len(prompt)} tokens + {room} more exceeds the decoder's "
                             f"{self.capacity} positions")
        if isinstance(self.session, StaticTarget):
            self.session.prepare(len(prompt), tokens, len(prompt) + room)

    def _prefill(self, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.session.prefill(torch.tensor([prompt], device=self.target.device))

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new_tokens: int, eos_ids: set[int]) -> DecodeResult:
        """The target's greedy reply, its tokens kept on the device and read back every
        EOS_CHECK_EVERY steps (only where `eos_ids` can end it early)."""
        device = self.target.device
        self._ready(prompt, max_new_tokens, 1)
        synchronize(device)
        start = time.perf_counter()
        choice, _ = self._prefill(prompt)
        synchronize(device)
        prefilled = time.perf_counter()
        new = torch.empty(max(max_new_tokens, 1), dtype=torch.long, device=device)
        new[:1] = choice[0, -1:]
        made, read = 1, 0  # tokens made; of them, read back and free of an end of sequence
        while made < max_new_tokens:
            if eos_ids and made - read >= EOS_CHECK_EVERY:
                if eos_ids.intersection(new[read:made].tolist()):
                    break
                read = made
            choice, _ = self.session.step(choice, len(prompt) + made - 1)
            new[made:made + 1] = choice[0, -1:]
            made += 1
        tokens = new[:made].tolist()
        return DecodeResult(tokens=_finish(tokens, max_new_tokens, eos_ids), seconds=time.perf_counter() - start,
                            prefill_seconds=prefilled - start)

    @torch.no_grad()
    def speculative(self, prompt: list[int], max_new_tokens: int, eos_ids: set[int]) -> DecodeResult:
        device, block, draft = self.target.device, self.drafter.block_size, self.draft
        self._ready(prompt, max_new_tokens + block, block)
        synchronize(device)
        start = time.perf_counter()
        choice, features = self._prefill(prompt)
        draft.extend(features, 0)
        proposal = draft.start(choice[0, -1:], len(prompt))
        tokens = [int(choice[0, -1])]
        prefilled = time.perf_counter()
        accepted: list[int] = []
        while len(tokens) < max_new_tokens and not eos_ids.intersection(tokens):
            anchor = len(prompt) + len(tokens) - 1
            choice, features = self.session.step(proposal, anchor)
            # choice[i]: the target's token for position anchor+i+1. The host reads it while the
            # drafter proposes the next block on the device: the one host sync of a cycle
            outcome = torch.cat([proposal[0, 1:], choice[0]])
            self.acceptance.start(outcome)
            proposal = draft.advance(outcome, features, anchor)
            both = self.acceptance.read()
            proposed, verified = both[: block - 1], both[block - 1:]
            k = next((i for i, (d, c) in enumerate(zip(proposed, verified)) if d != c), block - 1)
            tokens.extend(proposed[:k] + [verified[k]])
            accepted.append(k)
        synchronize(device)
        kept = _finish(tokens, max_new_tokens, eos_ids)
        if accepted:  # only the last cycle can run past the end: the loop stops after it
            accepted[-1] -= len(tokens) - len(kept)
        return DecodeResult(tokens=kept, seconds=time.perf_counter() - start, accepted=accepted,
                            prefill_seconds=prefilled - start)


def greedy_decode(target: FrozenTarget, prompt: list[int], max_new_tokens: int, eos_ids: set[int],
                  kind: str = "plain") -> DecodeResult:
    """One prompt; for many, make one Decoder and reuse it."""
    return Decoder(target, None, len(prompt) + max_new_tokens, kind).greedy(prompt, max_new_tokens, eos_ids)


def speculative_decode(target: FrozenTarget, drafter: DFlashDrafter, prompt: list[int], max_new_tokens: int,
                       eos_ids: set[int], kind: str = "plain") -> DecodeResult:
    decoder = Decoder(target, drafter, len(prompt) + max_new_tokens + drafter.block_size, kind)
    return decoder.speculative(prompt, max_new_tokens, eos_ids)
