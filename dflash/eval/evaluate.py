"""Judge drafters by real speculative decoding on held-out prompts: tau, acceptance by position,
speedup over greedy decoding and the lossless check, plus the teacher-forced chain training logs.
The library behind `python -m dflash.eval` (dflash/eval/__main__.py), the end of train_drafter.py
and the periodic exact tau (dflash/eval/periodic.py).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from dflash.data.chat_formats import DataError, load_chat_jsonl
from dflash.data.thinking import mismatch_error, resolve_thinking, thinking_kwargs
from dflash.data.tokenization import load_tokenizer, prompt_ids
from dflash.drafter.attention import BlockLayout, resolve_backend
from dflash.drafter.export import DrafterLoadError, load_drafter
from dflash.drafter.model import DFlashDrafter
from dflash.drafter.objective import anchor_candidates, expected_acceptance_length, slot_weights
from dflash.drafter.step import DrafterStep, StepSettings
from dflash.eval.speculative import Decoder, resolve_decoder
from dflash.target.frozen import FrozenTarget
from dflash.target.gguf import resolve_target

logger = logging.getLogger(__name__)


@dataclass
class EvalReport:
    prompts: int
    tau: float  # generated tokens per verify forward (accepted drafts + 1 bonus)
    acceptance: list[float]  # P(slot j accepted), j = 1..B-1
    speedup: float  # greedy seconds / speculative seconds
    greedy_seconds: float
    speculative_seconds: float
    tokens: int
    diverged: int  # prompts whose speculative output differs from greedy
    dtype: str = "float32"
    decoder: str = "plain"
    teacher_forced_acc: list[float] = field(default_factory=list)
    teacher_forced_streak: float = 0.0  # mean leading correct slots per block (no bonus)
    teacher_forced_eal: float = 0.0  # from per-slot accuracy (no bonus)
    teacher_forced_tau: float = 0.0  # exact tau from the teacher-forced chain walk (bonus included)

    def summary(self) -> str:
        acc = ", ".join(f"{a:.2f}" for a in self.acceptance[:8])
        return (
            f"tau {self.tau:.2f} (teacher-forced: chain {self.teacher_forced_tau:.2f}, "
            f"1+streak {1 + self.teacher_forced_streak:.2f}, "
            f"1+EAL {1 + self.teacher_forced_eal:.2f}) | speedup {self.speedup:.2f}x "
            f"({self.greedy_seconds:.2f}s greedy, {self.speculative_seconds:.2f}s speculative) | "
            f"acceptance by position [{acc}{', ...' if len(self.acceptance) > 8 else ''}] | "
            f"{self.greedy_tokens_per_second:.0f} -> {self.speculative_tokens_per_second:.0f} tokens/s | "
            f"{self.tokens} tokens, {self.prompts} prompts, {self.dtype}, {self.decoder} decoder | "
            f"identical to greedy on {self.prompts - self.diverged}/{self.prompts}"
        )

    @property
    def greedy_tokens_per_second(self) -> float:
        return self.tokens / max(self.greedy_seconds, 1e-9)

    @property
    def speculative_tokens_per_second(self) -> float:
        return self.tokens / max(self.speculative_seconds, 1e-9)

    @property
    def lossless(self) -> bool:
        return self.diverged == 0


def eos_token_ids(tokenizer, target: FrozenTarget) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    generation = getattr(target.model, "generation_config", None)
    extra = getattr(generation, "eos_token_id", None)
    ids.update(extra if isinstance(extra, list) else [extra] if extra is not None else [])
    return ids


@dataclass
class TeacherForced:
    """The drafter scored with every response position as an anchor, in one batched forward
    per sequence, on the target's own greedy continuations."""

    acc: list[float]  # per-slot accuracy, slots 1..B-1 (what training measures)
    streak: float  # mean leading correct slots over every anchor (no bonus)
    eal: float
    tau: float  # exact: the chain decoding walks, 1 + mean accepted per cycle
    acceptance: list[float]  # P(slot j accepted) along that chain, j = 1..B-1
    ce: float = 0.0  # the slot-weighted cross-entropy, averaged over the sequences: held-out loss


def chain_walk(streaks: list[int], produced: int) -> list[int]:
    """Accepted drafts per cycle of speculative decoding, from the teacher-forced streak of the
    block anchored at every response position: the first cycle is anchored at the first reply
    token, a cycle anchored at n accepts streak[n], the target adds one token, so the next is
    anchored at n + streak[n] + 1; decoding stops once `produced` reply tokens exist (the end of
    sequence, or max_new_tokens), and the last cycle's tokens past them are not counted, as
    speculative decoding counts them."""
    accepted, anchor = [], 0
    while anchor + 1 < produced and anchor < len(streaks):
        accepted.append(min(streaks[anchor], produced - 2 - anchor))
        anchor += streaks[anchor] + 1
    return accepted


def continuation(decoder: Decoder, prompt: list[int], max_new_tokens: int, eos_ids: set[int],
                 block_size: int, reply: list[int] | None = None) -> tuple[list[int], int]:
    """The target's greedy continuation, B-1 tokens past where decoding stops (its last cycle
    still checks a whole block there), and how many reply tokens decoding keeps. The reply stops
    at its end of sequence (`reply`: that greedy decode, where the caller has it already), and the
    B-1 tokens after it come from a second, short decode: most replies end long before
    max_new_tokens, and decoding on to it cost 2-3x the reply."""
    if reply is None:
        reply = decoder.greedy(prompt, max_new_tokens, eos_ids).tokens
    return reply + decoder.greedy(prompt + reply, block_size - 1, eos_ids=set()).tokens, len(reply)


FeaturesOf = Callable[[int, torch.Tensor], torch.Tensor]  # (sequence index, ids [1, S]) -> features [1, S, F]


def target_features(target: FrozenTarget) -> FeaturesOf:
    """Features computed by the target as each sequence comes (it is on this rank)."""
    return lambda _, ids: target.features(ids).features


@torch.no_grad()
def teacher_forced(drafter: DFlashDrafter, embed_tokens: torch.nn.Module, lm_head: torch.nn.Module,
                   sequences: list[tuple[list[int], list[int], int]], features_of: FeaturesOf) -> TeacherForced:
    """`sequences`: (prompt, continuation, reply tokens decoding keeps), from `continuation`; the
    target's features of each come from `features_of` (computed here, or computed once elsewhere)."""
    device = embed_tokens.weight.device
    block = drafter.block_size
    settings = StepSettings(max_anchors=0, slot_weights=slot_weights(block, 1.0),
                            attention_backend=resolve_backend("auto", device))
    step = DrafterStep(drafter, embed_tokens, lm_head, settings)
    correct = torch.zeros(block, dtype=torch.float64)
    count = torch.zeros(block, dtype=torch.float64)
    streaks: list[torch.Tensor] = []
    accepted: list[int] = []
    ces: list[float] = []
    for index, (prompt, response, kept) in enumerate(sequences):
        ids = torch.tensor([prompt + response], device=device)
        loss_mask = torch.zeros_like(ids, dtype=torch.bool)
        loss_mask[:, len(prompt):] = True
        anchors = anchor_candidates(loss_mask)[0].nonzero().flatten()[None]  # every response position
        if anchors.numel() == 0:
            continue
        layout = BlockLayout(anchors, torch.ones_like(anchors, dtype=torch.bool), ids.shape[1], block)
        out = step.loss(step.make_blocks(ids, loss_mask, layout), features_of(index, ids))
        correct += out.slot_correct.double().cpu()
        count += out.slot_count.double().cpu()
        streaks.append(out.block_streaks.double().cpu())
        ces.append(float(out.ce))
        accepted += chain_walk(out.block_streaks.long().tolist(), kept)
    acc = correct / count.clamp(min=1)
    chain = torch.tensor(accepted or [0], dtype=torch.float64)
    return TeacherForced(
        acc=[float(a) for a in acc[1:]], streak=float(torch.cat(streaks).mean()) if streaks else 0.0,
        eal=expected_acceptance_length(acc), tau=float(chain.mean() + 1),
        acceptance=[float((chain >= j).double().mean()) for j in range(1, block)],
        ce=sum(ces) / max(len(ces), 1))


def evaluate(target: FrozenTarget, drafter: DFlashDrafter, prompts: list[list[int]], max_new_tokens: int,
             eos_ids: set[int], decoder: str = "auto", continuations: dict | None = None) -> EvalReport:
    """Greedy against speculative decoding of each prompt, and the teacher-forced measures on the
    target's continuations. `continuations`: a dict that keeps those per block size, so that the
    drafters judged on one target and prompts share them (they take a greedy decode each)."""
    drafter = drafter.to(target.device, target.embed_tokens.weight.dtype).eval()
    kind = resolve_decoder(decoder, target)
    block = drafter.block_size
    decode = Decoder(target, drafter, max(map(len, prompts)) + max_new_tokens + block, kind)
    decode.greedy(prompts[0], 4, eos_ids)  # warm-up: first calls pay one-off costs (and capture graphs)
    decode.speculative(prompts[0], 4, eos_ids)
    greedy_s = spec_s = 0.0
    accepted: list[int] = []
    tokens = 0
    diverged = 0
    replies = []
    for prompt in prompts:
        plain = decode.greedy(prompt, max_new_tokens, eos_ids)
        replies.append(plain.tokens)
        spec = decode.speculative(prompt, max_new_tokens, eos_ids)
        if spec.tokens != plain.tokens:
            diverged += 1
            # a bug in float32; in bfloat16 a near-tie rounded two ways (check_lossless sums them up)
            exact = target.embed_tokens.weight.dtype == torch.float32
            (logger.error if exact else logger.info)("speculative output differs from greedy on a prompt of %d "
                                                     "tokens", len(prompt))
        greedy_s += plain.seconds
        spec_s += spec.seconds
        accepted += spec.accepted
        tokens += len(spec.tokens)
    continuations = {} if continuations is None else continuations
    if block not in continuations:
        continuations[block] = [(p, *continuation(decode, p, max_new_tokens, eos_ids, block, reply))
                                for p, reply in zip(prompts, replies)]
    sequences = continuations[block]
    accepted_t = torch.tensor(accepted or [0], dtype=torch.float64)
    acceptance = [float((accepted_t >= j).double().mean()) for j in range(1, block)]
    tf = teacher_forced(drafter, target.embed_tokens, target.lm_head, sequences, target_features(target))
    return EvalReport(
        prompts=len(prompts), tau=float(accepted_t.mean() + 1), acceptance=acceptance,
        speedup=greedy_s / max(spec_s, 1e-9), greedy_seconds=greedy_s, speculative_seconds=spec_s,
        tokens=tokens, diverged=diverged, dtype=str(target.embed_tokens.weight.dtype).removeprefix("torch."),
        decoder=kind,
        teacher_forced_acc=tf.acc, teacher_forced_streak=tf.streak, teacher_forced_eal=tf.eal,
        teacher_forced_tau=tf.tau,
    )


def load_prompts(path: str, tokenizer, limit: int, thinking: str = "none") -> list[list[int]]:
    """The first `limit` prompts of a chat file, rendered in a resolved thinking mode (none: the
    chat template's own render)."""
    conversations = load_chat_jsonl(path, require_reply=False)[:limit]
    prompts = []
    for number, messages in enumerate(conversations, start=1):
        try:
            prompts.append(prompt_ids(tokenizer, messages, **thinking_kwargs(thinking)))
        except DataError as err:
            raise DataError(f"{path}: conversation {number}: {err}") from err
    return prompts


def evaluate_drafters(
    target_path: str, tokenizer_path: str, drafters: dict[str, str | Path], prompts_path: str,
    num_prompts: int, max_new_tokens: int, device: torch.device, dtype: torch.dtype = torch.float32,
    decoder: str = "auto", thinking: str = "auto",
) -> dict[str, EvalReport]:
    """Load the target once and judge each named drafter folder on the same prompts, rendered in
    the `thinking` mode (--thinking, resolved): a drafter that records another one is refused."""
    tokenizer = load_tokenizer(tokenizer_path)
    mode = resolve_thinking(tokenizer, thinking)
    prompts = load_prompts(prompts_path, tokenizer, num_prompts, mode)  # cheap checks before the target loads
    loaded = {name: load_drafter(path) for name, path in drafters.items()}
    for name, drafter in loaded.items():
        trained = drafter.config.dflash_config.get("thinking")  # None: exported before drafters recorded it
        if trained is not None and trained != mode:
            raise mismatch_error(trained, f"--drafter {drafters[name]} (dflash_config in its config.json)", mode,
                                 "the drafter")
    layer_ids = {tuple(d.config.dflash_config["target_layer_ids"]) for d in loaded.values()}
    if len(layer_ids) != 1:
        raise DrafterLoadError(f"drafters {list(drafters)} read different target layers {sorted(layer_ids)}")
    target = FrozenTarget.load(resolve_target(target_path), list(layer_ids.pop()), dtype, device)
    eos = eos_token_ids(tokenizer, target)
    reports, continuations = {}, {}
    for name, drafter in loaded.items():
        reports[name] = evaluate(target, drafter, prompts, max_new_tokens, eos, decoder, continuations)
        logger.info("eval %s: %s", name, reports[name].summary())
    return reports


def check_lossless(reports: dict[str, EvalReport]) -> bool:
    """In float32 any difference from greedy decoding is a bug. In bfloat16 a B-token verify
    and 1-token steps round differently, so near-tied logits can flip: reported, not fatal."""
    for name, report in reports.items():
        if report.lossless:
            continue
        if report.dtype == "float32":
            logger.error("%s: speculative output differs from greedy in float32: a bug, please report it", name)
            return False
        logger.warning("%s: %d/%d prompts diverged from greedy in %s (rounding near-ties); rerun with "
                       "--dtype float32 for the exact check", name, report.diverged, report.prompts, report.dtype)
    return True


def write_reports(reports: dict[str, EvalReport], path: str | Path) -> None:
    Path(path).write_text(json.dumps({k: {**asdict(v), "lossless": v.lossless,
                                          "greedy_tokens_per_second": v.greedy_tokens_per_second,
                                          "speculative_tokens_per_second": v.speculative_tokens_per_second}
                                      for k, v in reports.items()}, indent=2) + "\n")
