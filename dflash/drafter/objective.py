"""The DFlash training objective: anchors -> blocks -> weighted cross-entropy (+ KL), metrics.

Shapes: b sequences of padded length S, N blocks per sequence (padded), B slots per block,
Q = N * B query positions per sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash.drafter.attention import BlockLayout
from dflash.util.runtime import compile_dynamic, to_device_async


def default_gamma(block_size: int) -> float:
    """Slot-weight decay of the published recipe: 7 for B=16, 5 for B=10, 4 for B=8."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size * 7.0 / 16.0))


def slot_weights(block_size: int, gamma: float | None) -> torch.Tensor:
    """w_j = exp(-(j-1)/gamma) for slots j = 1..B-1, or 1 for every slot when gamma is None
    (uniform); slot 0 (the anchor) weighs 0."""
    j = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(j - 1) / gamma) if gamma is not None else torch.ones(block_size)
    weights[0] = 0.0
    return weights


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """[b, S] bool: positions a where the loss mask holds at a and a+1 (response tokens)."""
    candidates = torch.zeros_like(loss_mask)
    candidates[:, :-1] = loss_mask[:, :-1] & loss_mask[:, 1:]
    return candidates


def sample_anchors(
    loss_mask: torch.Tensor, max_anchors: int, block_size: int, generator: torch.Generator, stride: bool = False,
    echo_round: int = 0, count: int | None = None,
) -> BlockLayout:
    """Up to `max_anchors` anchors per sequence, uniformly without replacement among the
    candidates, sorted. Padding blocks (anchor 0, valid False) fill shorter rows. `stride`: only
    candidates B apart from each row's first one (consecutive, non-overlapping blocks). The
    generator puts each row's candidates in a random order and echo_round 0 takes its first
    max_anchors; round k (an echo of the micro-batch, --reuse-features) the next max_anchors
    along the same order, wrapping around once a row's candidates are used up. `count`: the most
    anchors a row takes (min(candidates, max_anchors), 1 at least), where the caller counted it on
    the host (training: per sample, from the shard); else it is read back from the device, a sync
    that leaves the GPU idle while the host queues the drafter's step."""
    candidates = anchor_candidates(loss_mask)
    if stride:
        first = candidates.float().argmax(dim=1, keepdim=True)
        offset = torch.arange(candidates.shape[1], device=candidates.device)[None] - first
        candidates = candidates & (offset % block_size == 0)
    scores = to_device_async(torch.rand(candidates.shape, generator=generator), candidates.device)
    scores = scores.masked_fill(~candidates, -1.0)
    available = candidates.sum(dim=1, keepdim=True)  # [b, 1]
    taken = available.clamp(max=max_anchors)
    if count is None or taken.device.type == "cpu":  # where reading back costs nothing, check the host's count
        widest = max(int(taken.max().item()), 1)
        if count is not None and count != widest:
            raise ValueError(f"sample_anchors: told {count} anchors for the widest row, which takes {widest}: the "
                             "host's per-sample anchor counts disagree with these loss masks")
        count = widest
    ranked = scores.argsort(dim=1, descending=True)  # a row's candidates first, in random order
    slot = torch.arange(count, device=candidates.device)[None]
    along = (echo_round * max_anchors + slot) % available.clamp(min=1)
    valid = slot < taken
    anchors = torch.where(valid, ranked.gather(1, along), torch.zeros_like(along))
    # Sort real anchors ascending; padding (pushed to the end with a large key) keeps anchor 0.
    order = torch.where(valid, anchors, torch.full_like(anchors, loss_mask.shape[1])).argsort(dim=1)
    return BlockLayout(
        anchors=anchors.gather(1, order),
        valid=valid.gather(1, order),
        context_len=loss_mask.shape[1],
        block_size=block_size,
    )


@dataclass
class Blocks:
    """Everything the drafter forward and the loss need about the blocks of a micro-batch."""

    layout: BlockLayout
    input_ids: torch.Tensor  # [b, Q] anchor token then mask tokens
    positions: torch.Tensor  # [b, Q] absolute position a + j
    labels: torch.Tensor  # [b, Q] x[a + j] (0 where out of range)
    label_mask: torch.Tensor  # [b, Q] scored: real block, j >= 1, a..a + j all in the loss mask


def build_blocks(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, layout: BlockLayout, mask_token_id: int
) -> Blocks:
    """Block inputs `[x_a, MASK, ...]`, positions and labels: slot j is scored on x[a + j] when every
    position a..a+j is in the loss mask. A block stays inside its reply: with several replies in
    the loss (--loss-turns all), one anchored near a reply's end never scores the next reply,
    which lies past a user turn the drafter would have to guess (and never drafts at serving)."""
    s, block_size = input_ids.shape[1], layout.block_size
    j = torch.arange(block_size, device=input_ids.device)
    positions = layout.anchors[:, :, None] + j  # [b, N, B]
    in_range = positions < s
    safe = positions.clamp(max=s - 1)
    labels = input_ids.gather(1, safe.flatten(1)).view_as(positions)
    in_reply = loss_mask.gather(1, safe.flatten(1)).view_as(positions) & in_range
    scored = in_reply.long().cumprod(dim=-1).bool()  # the run of masked positions from the anchor on
    scored &= layout.valid[:, :, None] & (j >= 1)
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[:, :, 0] = labels[:, :, 0]
    return Blocks(
        layout=layout,
        input_ids=block_ids.flatten(1),
        positions=positions.flatten(1),
        labels=torch.where(scored, labels, torch.zeros_like(labels)).flatten(1),
        label_mask=scored.flatten(1),
    )


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, what backward sees (over the step's global denominators)
    mean_loss: torch.Tensor  # the same terms over this micro-batch's own denominators (detached)
    ce: torch.Tensor  # weighted cross-entropy part (detached)
    kl: torch.Tensor  # weighted KL part (detached; 0 when distillation is off)
    slot_correct: torch.Tensor  # [B] correct predictions per slot (detached)
    slot_count: torch.Tensor  # [B] scored predictions per slot
    block_streaks: torch.Tensor  # [#blocks] leading correct slots of each real block
    distinct_predictions: torch.Tensor  # how many distinct tokens the argmax drafts at the scored slots (0-d)


def dpace_weights(ce: torch.Tensor, scored: torch.Tensor, block_size: int, alpha: float) -> torch.Tensor:
    """D-PACE position weights (detached) for the scored slots of [b, Q] blocks: the draft's
    confidence q = exp(-CE) in the right token, smoothed to q~ = (1 - alpha) q + alpha, and
    w_j = sum over scored m >= j of prod_{i <= m} q~_i: the expected accepted length that slot j
    still leads to. Unscored slots count as certain in the products and add nothing to the sums.
    `ce` holds the per-slot CE at the scored slots (anything elsewhere)."""
    with torch.no_grad():
        b = scored.shape[0]
        q = torch.where(scored, (1 - alpha) * torch.exp(-ce.float()) + alpha, torch.ones_like(ce, dtype=torch.float32))
        prefix = q.view(b, -1, block_size).cumprod(dim=-1) * scored.view(b, -1, block_size)
        suffix = prefix.flip(-1).cumsum(-1).flip(-1)
        return (suffix.view(b, -1) * scored).detach()


@dataclass
class LossDenominators:
    """What the loss terms are divided by: the slot weights and the number of scored slots.
    Summed over every micro-batch of an optimizer step on every drafter rank, they make the
    update independent of how samples fall on ranks and accumulation steps; `scale` (drafter
    ranks x accumulation steps) undoes the engine's averaging over both."""

    weight: torch.Tensor
    positions: torch.Tensor
    scale: float = 1.0

    @staticmethod
    def of(blocks: Blocks, weights: torch.Tensor) -> LossDenominators:
        """One micro-batch's sums (no host sync: no nonzero, no item)."""
        mask = blocks.label_mask
        per_slot = mask.view(mask.shape[0], -1, blocks.layout.block_size).float() * weights.to(mask.device)
        return LossDenominators(per_slot.sum(), mask.sum().float())


@dataclass
class LossTerms:
    """Which losses make up the objective, and their knobs."""

    kind: str = "ce"  # ce (slot weights) | dpace | ce+dpace
    dpace_alpha: float = 0.5
    dpace_weight: float = 1.0  # of the D-PACE term in ce+dpace


def kept_gradient_scale(per_micro: torch.Tensor, skipped: list[bool], terms: LossTerms,
                        kl_weight: float) -> float | None:
    """The factor that turns an optimizer step's gradient, accumulated with the denominators of
    all its micro-batches (`per_micro` [n, 2]: each one's weight and position sums over the
    drafter ranks), into the mean over the micro-batches kept (`skipped`: a flag each). None where
    no factor does, and the step is skipped whole: nothing kept to learn from, or a loss over both
    normalisers (CE or KL over weights, D-PACE over positions) that the skips changed unequally."""
    if not any(skipped):
        return 1.0
    kept = ~torch.tensor(skipped, device=per_micro.device)
    total, left = per_micro.double().sum(0), per_micro.double()[kept].sum(0)
    used = [i for i, on in enumerate((terms.kind != "dpace" or kl_weight > 0, terms.kind != "ce")) if on]
    if any(float(left[i]) <= 0 for i in used):
        return None
    ratios = [float(total[i] / left[i]) for i in used]
    return ratios[0] if all(math.isclose(r, ratios[0], rel_tol=1e-12) for r in ratios) else None


def dflash_loss(
    hidden: torch.Tensor,
    blocks: Blocks,
    lm_head: torch.nn.Module,
    weights: torch.Tensor,
    teacher_hidden: torch.Tensor | None = None,
    kl_weight: float = 0.0,
    chunk_size: int = 4096,
    fused: bool = True,
    terms: LossTerms | None = None,
    denominators: LossDenominators | None = None,
) -> LossOutput:
    """The objective over scored slots: slot-weighted CE sum(w * m * CE) / sum(w * m), or the
    D-PACE-weighted CE sum(w_dpace * CE) / sum(m), or both (`terms`), + kl_weight * the
    slot-weighted KL to the target's distribution. The denominators are this micro-batch's, or
    the optimizer step's (`denominators`) for the loss backward sees. Only scored positions go
    through the lm_head, in chunks, so [positions x vocab] logits never exist all at once;
    `fused` (no KL) takes each chunk's gradient in the forward.

    hidden [b, Q, D] drafter output; teacher_hidden [b, S, D] the target's final normed hidden
    state: its row a+j-1 gives the target's distribution for x[a+j].
    """
    terms = terms or LossTerms()
    bs = blocks.layout.block_size
    mask = blocks.label_mask
    sel = mask.nonzero(as_tuple=True)
    slots = sel[1] % bs
    w = weights.to(hidden.device)[slots]
    distill = teacher_hidden is not None and kl_weight > 0
    teacher = (teacher_hidden, (blocks.positions - 1)[sel], sel[0]) if distill else None
    ce_rows, kl_rows, predicted = row_losses(hidden[sel], lm_head, blocks.labels[sel], chunk_size, fused, teacher)
    correct = predicted == blocks.labels[sel]
    sums = {"ce": (ce_rows * w).sum(), "kl": (kl_rows * w).sum()}
    if terms.kind in ("dpace", "ce+dpace"):
        full = torch.zeros(mask.shape, device=hidden.device)
        full[sel] = ce_rows.detach()
        sums["dpace"] = (ce_rows * dpace_weights(full, mask, bs, terms.dpace_alpha)[sel]).sum()
    local = LossDenominators.of(blocks, weights)

    def combine(den: LossDenominators) -> torch.Tensor:
        weight, positions = den.weight.clamp(min=1e-6), den.positions.clamp(min=1)
        total = sums["ce"] / weight if terms.kind != "dpace" else sums["ce"].new_zeros(())
        if "dpace" in sums:
            total = total + (terms.dpace_weight if terms.kind == "ce+dpace" else 1.0) * sums["dpace"] / positions
        if kl_weight > 0:
            total = total + kl_weight * sums["kl"] / weight
        return total * den.scale

    slot_correct = torch.zeros(bs, device=hidden.device).index_add_(0, slots, correct.float())
    slot_count = torch.zeros(bs, device=hidden.device).index_add_(0, slots, torch.ones_like(w))
    weight_sum = local.weight.clamp(min=1e-6).detach()
    return LossOutput(loss=combine(denominators or local), mean_loss=combine(local).detach(),
                      ce=sums["ce"].detach() / weight_sum, kl=sums["kl"].detach() / weight_sum,
                      slot_correct=slot_correct, slot_count=slot_count,
                      block_streaks=block_streaks(correct, mask, bs),
                      distinct_predictions=distinct_count(predicted, lm_head.weight.shape[0]))


def distinct_count(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """How many distinct values `ids` holds (0-d float), without a host sync (torch.unique has one)."""
    seen = torch.zeros(vocab, dtype=torch.bool, device=ids.device)
    return seen.index_fill_(0, ids, True).sum().float()


def row_losses(h: torch.Tensor, lm_head: torch.nn.Module, labels: torch.Tensor, chunk_size: int, fused: bool,
               teacher=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per scored row: CE (float32, differentiable in h), KL to the teacher (zeros without one),
    the argmax row. `teacher` = (teacher_hidden [b, S, D], row index, batch index) per row."""
    if fused:
        teacher_rows = None
        if teacher is not None:
            teacher_hidden, rows, batch = teacher
            teacher_rows = teacher_hidden[batch, rows]
        return linear_cross_entropy(h, lm_head.weight, labels, chunk_size, teacher_rows)
    ce_parts, kl_parts, predicted_parts = [], [], []
    for start in range(0, h.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        logits = lm_head(h[part]).float()
        ce_parts.append(F.cross_entropy(logits, labels[part], reduction="none"))
        predicted_parts.append(logits.argmax(-1))
        if teacher is None:
            kl_parts.append(torch.zeros_like(ce_parts[-1]))
            continue
        teacher_hidden, rows, batch = teacher
        with torch.no_grad():
            teacher_logp = F.log_softmax(lm_head(teacher_hidden[batch[part], rows[part]]).float(), dim=-1)
        kl_parts.append(F.kl_div(F.log_softmax(logits, -1), teacher_logp, log_target=True, reduction="none").sum(-1))
    if not ce_parts:  # no scored slot: an empty CE that still belongs to the graph
        empty = h.float().sum(-1)
        return empty, empty.detach(), torch.zeros(0, dtype=torch.long, device=h.device)
    return torch.cat(ce_parts), torch.cat(kl_parts), torch.cat(predicted_parts)


def _cross_entropy_chunk(logits: torch.Tensor, labels: torch.Tensor, want_grad: bool):
    """One chunk of logits [n, V] (the lm_head's dtype): (CE per row, the argmax row, and
    dCE/d logits = softmax - onehot in the logits' dtype, or None). Written as plain tensor code
    so that on a GPU `torch.compile` fuses it into a reduction over V and one pointwise pass,
    instead of eager passes that each write an [n, V] float32 array."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    target = x.gather(1, labels[:, None]).squeeze(1)
    predicted = x.argmax(dim=-1)
    if not want_grad:
        return lse - target, predicted, None
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == labels[:, None]
    grad = (x - lse[:, None]).exp() - onehot.float()
    return lse - target, predicted, grad.to(logits.dtype)


def _distillation_chunk(logits: torch.Tensor, teacher_logits: torch.Tensor, want_grad: bool):
    """One chunk's KL(target || drafter) per row, and dKL/d logits = softmax(logits) - the
    target's probabilities (in the logits' dtype, or None)."""
    log_q = torch.log_softmax(logits.float(), dim=-1)
    log_p = torch.log_softmax(teacher_logits.float(), dim=-1)
    p = log_p.exp()
    kl = (p * (log_p - log_q)).sum(dim=-1)
    return kl, (log_q.exp() - p).to(logits.dtype) if want_grad else None


_compiled: dict = {}


def compiled(fn):
    """`fn` compiled once per process (dynamic: chunks vary in rows), for CUDA tensors; on the
    CPU the plain function runs."""
    def run(*args):
        if args[0].device.type != "cuda":
            return fn(*args)
        if fn not in _compiled:
            _compiled[fn] = compile_dynamic(fn)
        return _compiled[fn](*args)
    return run


cross_entropy_chunk = compiled(_cross_entropy_chunk)
distillation_chunk = compiled(_distillation_chunk)


class _LinearCrossEntropy(torch.autograd.Function):
    """CE(h_i @ W^T, y_i) per row, and optionally KL(target_i || softmax(h_i @ W^T)) with the
    target's distribution softmax(t_i @ W^T), with each row's gradients for h computed chunk by
    chunk in the forward pass: only [N, D] is kept for backward, never [N, V] logits (for a
    152K vocab that is 1.2 MB per scored position in float32, several GB per sequence). Rows are
    independent, so any weighting of the rows afterwards (slot weights, D-PACE, a global
    normaliser) only scales each row's kept gradients."""

    @staticmethod
    def forward(ctx, h, weight, labels, chunk_size, teacher_rows):
        want_grad = ctx.needs_input_grad[0]
        distill = teacher_rows is not None
        grad_ce = torch.empty_like(h) if want_grad else None
        grad_kl = torch.empty_like(h) if want_grad and distill else None
        ce = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        kl = torch.zeros(h.shape[0], dtype=torch.float32, device=h.device)
        predicted = torch.empty(h.shape[0], dtype=torch.long, device=h.device)
        for start in range(0, h.shape[0], chunk_size):
            part = slice(start, start + chunk_size)
            logits = h[part] @ weight.t()
            ce[part], predicted[part], grad_logits = cross_entropy_chunk(logits, labels[part], want_grad)
            if want_grad:
                grad_ce[part] = grad_logits @ weight
            if distill:
                kl[part], grad_logits = distillation_chunk(logits, teacher_rows[part] @ weight.t(), want_grad)
                if want_grad:
                    grad_kl[part] = grad_logits @ weight
        ctx.save_for_backward(grad_ce, grad_kl)
        ctx.mark_non_differentiable(predicted)
        return ce, kl, predicted

    @staticmethod
    def backward(ctx, grad_ce_rows, grad_kl_rows, _grad_predicted):
        grad_ce, grad_kl = ctx.saved_tensors
        grad_h = grad_ce * grad_ce_rows.to(grad_ce.dtype)[:, None]
        if grad_kl is not None:
            grad_h = grad_h + grad_kl * grad_kl_rows.to(grad_kl.dtype)[:, None]
        return grad_h, None, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int = 4096,
                         teacher_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(CE of h @ weight^T against labels per row as float32, KL(softmax(teacher_rows @ weight^T)
    || softmax(h @ weight^T)) per row (zeros without teacher rows), the argmax row of each row);
    the weight is frozen (no gradient for it)."""
    teacher_rows = None if teacher_rows is None else teacher_rows.detach()
    return _LinearCrossEntropy.apply(h, weight.detach(), labels, chunk_size, teacher_rows)


def block_streaks(correct: torch.Tensor, mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """Teacher-forced streak of every block: how many slots 1.. are right before the first miss
    (an unscored slot ends the streak). `correct` is aligned with mask.nonzero()."""
    full = torch.zeros(mask.shape, dtype=torch.bool, device=mask.device)
    full[mask] = correct
    per_block = full.view(mask.shape[0], -1, block_size)[:, :, 1:]
    has_label = mask.view(mask.shape[0], -1, block_size)[:, :, 1].flatten()
    streak = per_block.long().cumprod(dim=-1).sum(dim=-1).flatten()
    return streak[has_label]


def expected_acceptance_length(slot_accuracy: torch.Tensor) -> float:
    """EAL = sum_{k=1}^{B-1} prod_{j<=k} acc_j over slots 1..B-1 (the +1 bonus NOT included)."""
    acc = slot_accuracy[1:].double()
    return float(torch.cumprod(acc, dim=0).sum())
