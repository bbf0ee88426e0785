"""One drafter forward on a micro-batch: target features in, DFlash loss and metrics out.

Shared by training (with backward) and by evaluation's teacher-forced streak (without), so the
number training shows and the number eval reports come from the same code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from dflash.drafter.attention import FLEX_MIN_QUERY_ROWS, BlockLayout, build_mask, pad_blocks
from dflash.drafter.model import DFlashDrafter
from dflash.drafter.objective import (Blocks, LossDenominators, LossOutput, LossTerms, build_blocks, dflash_loss,
                                      sample_anchors)
from dflash.drafter.vocab import DraftHead


@dataclass
class StepSettings:
    max_anchors: int
    slot_weights: torch.Tensor  # [B]
    attention_backend: str  # "sdpa" or "flex" (already resolved)
    kl_weight: float = 0.0
    lm_head_chunk: int = 4096
    fused_loss: bool = True  # False: autograd keeps the logits (the naive reference)
    terms: LossTerms = field(default_factory=LossTerms)
    stride_anchors: bool = False  # blocks B apart instead of random anchors (an ablation)
    zero_features: bool = False  # the drafter sees zeros for the target's features (a control)


class DrafterStep:
    """Wires the drafter to the target's frozen embedding and lm_head (shared, not copied; with a
    draft vocabulary, the rows of it the drafter drafts from)."""

    def __init__(
        self, drafter: DFlashDrafter, embed_tokens: nn.Module, lm_head: nn.Module | DraftHead, settings: StepSettings,
        forward: nn.Module | None = None,
    ):
        self.drafter = drafter
        self.forward = forward or drafter  # the DeepSpeed engine when training
        self.embed_tokens = embed_tokens
        self.lm_head = DraftHead.of(drafter, lm_head)
        self.settings = settings
        # where the loss is computed: a copy from host memory at every micro-batch would make the
        # host wait for the GPU
        self.slot_weights = settings.slot_weights.to(embed_tokens.weight.device)

    def make_blocks(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, layout: BlockLayout) -> Blocks:
        layout = dataclasses.replace(layout, window=self.drafter.window)  # the drafter's own window
        if self.settings.attention_backend == "flex":
            layout = pad_blocks(layout, FLEX_MIN_QUERY_ROWS)
        return self.lm_head.restrict(build_blocks(input_ids, loss_mask, layout, self.drafter.mask_token_id))

    def sample_blocks(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, generator: torch.Generator,
                      echo_round: int = 0, anchors_per_row: list[int] | None = None) -> Blocks:
        """`echo_round`: the echo of the micro-batch (sample_anchors), 0 for its first step;
        `anchors_per_row`: each row's anchor count, min(candidates, --max-anchors), where the host
        knows it (no read-back of the widest row; ignored with stride anchors, which take fewer)."""
        count = None if anchors_per_row is None or self.settings.stride_anchors else max(anchors_per_row)
        layout = sample_anchors(loss_mask, self.settings.max_anchors, self.drafter.block_size, generator,
                                stride=self.settings.stride_anchors, echo_round=echo_round, count=count)
        return self.make_blocks(input_ids, loss_mask, layout)

    def hidden(self, blocks: Blocks, features: torch.Tensor) -> torch.Tensor:
        """Drafter output [b, Q, D] for all blocks at once, under the DFlash attention mask."""
        b, s = features.shape[:2]
        context_positions = torch.arange(s, device=features.device)[None].expand(b, -1)
        with torch.no_grad():
            block_embeds = self.embed_tokens(blocks.input_ids)
        mask = build_mask(blocks.layout, self.settings.attention_backend)
        return self.forward(block_embeds, blocks.positions, features, context_positions, mask)

    def loss(self, blocks: Blocks, features: torch.Tensor, final_hidden: torch.Tensor | None = None,
             noise_std: float = 0.0, denominators: LossDenominators | None = None) -> LossOutput:
        """Weighted CE (+KL against the target's `final_hidden`) of the blocks; `noise_std` > 0 adds
        Gaussian noise to the features (drawn from the global RNG, which checkpoints save and restore).
        `denominators`: the optimizer step's, for the loss backward sees (default: this micro-batch's)."""
        if self.settings.zero_features:
            features = torch.zeros_like(features)
        if noise_std > 0:
            features = features + noise_std * torch.randn_like(features)
        hidden = self.hidden(blocks, features)
        teacher = final_hidden if self.settings.kl_weight > 0 else None
        return dflash_loss(
            hidden, blocks, self.lm_head, self.slot_weights,
            teacher_hidden=teacher, kl_weight=self.settings.kl_weight, chunk_size=self.settings.lm_head_chunk,
            fused=self.settings.fused_loss, terms=self.settings.terms, denominators=denominators,
        )

    def denominators(self, blocks: Blocks) -> LossDenominators:
        return LossDenominators.of(blocks, self.slot_weights)

    def empty_loss(self) -> LossOutput:
        """A zero loss wired to every parameter: a rank with no samples at a step still joins
        the gradient all-reduce, so data-parallel ranks stay in lockstep."""
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        zero = sum(p.sum() for p in params) * 0.0
        bs = self.drafter.block_size
        nothing = torch.zeros(bs, device=zero.device)
        return LossOutput(loss=zero, mean_loss=zero.detach(), ce=zero.detach(), kl=zero.detach(), slot_correct=nothing,
                          slot_count=nothing.clone(), block_streaks=torch.zeros(0, device=zero.device),
                          distinct_predictions=zero.detach())
