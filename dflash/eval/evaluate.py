"""Judge drafters by real speculative decoding on held-out prompts: tau, acceptance by position,
speedup over greedy decoding and the lossless check, plus the teacher-forced chain training logs.
The library behind `python -m dflash.eval` (dflash/eval/__main__.py), the end of train_drafter.py
and the periodic exact tau (dflash/eval/periodic.py).
"""

from __future__ import annotations

import json
import logging
import time
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


@dataclass
class TeacherForcedTally:
    """The counts behind TeacherForced: they add up exactly over sequences scored apart (on
    other ranks, say), and summary() gives the same figures as scoring them all in one place."""

    correct: list[float]  # per slot 0..B-1
    count: list[float]
    streak_sum: float = 0.0  # leading correct slots, over every anchor
    anchors: int = 0
    chain: list[int] = field(default_factory=list)  # accepted drafts per cycle of the chain walk
    ce_sum: float = 0.0
    sequences: int = 0

    def __add__(self, other: TeacherForcedTally) -> TeacherForcedTally:
        return TeacherForcedTally([a + b for a, b in zip(self.correct, other.correct)],
                                  [a + b for a, b in zip(self.count, other.count)],
                                  self.streak_sum + other.streak_sum, self.anchors + other.anchors,
                                  self.chain + other.chain, self.ce_sum + other.ce_sum,
                                  self.sequences + other.sequences)

    def summary(self) -> TeacherForced:
        acc = torch.tensor(self.correct, dtype=torch.float64) / torch.tensor(self.count, dtype=torch.float64).clamp(min=1)
        chain = torch.tensor(self.chain or [0], dtype=torch.float64)
        return TeacherForced(
            acc=[float(a) for a in acc[1:]], streak=self.streak_sum / self.anchors if self.anchors else 0.0,
            eal=expected_acceptance_length(acc), tau=float(chain.mean() + 1),
            acceptance=[float((chain >= j).double().mean()) for j in range(1, len(self.correct))],
            ce=self.ce_sum / max(self.sequences, 1))


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
def teacher_forced_tally(drafter: DFlashDrafter, embed_tokens: torch.nn.Module, lm_head: torch.nn.Module,
                         sequences: list[tuple[list[int], list[int], int]], features_of: FeaturesOf) -> TeacherForcedTally:
    """`sequences`: (prompt, continuation, reply tokens decoding keeps), from `continuation`; the
    target's features of each come from `features_of` (computed here, or computed once elsewhere)."""
    device = embed_tokens.weight.device
    block = drafter.block_size
    settings = StepSettings(max_anchors=0, slot_weights=slot_weights(block, 1.0),
                            attention_backend=resolve_backend("auto", device))
    step = DrafterStep(drafter, embed_tokens, lm_head, settings)
    correct = torch.zeros(block, dtype=torch.float64)
    count = torch.zeros(block, dtype=torch.float64)
    tally = TeacherForcedTally([0.0] * block, [0.0] * block)
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
        streaks = out.block_streaks.long().cpu()
        tally.streak_sum += float(streaks.sum())
        tally.anchors += streaks.numel()
        tally.chain += chain_walk(streaks.tolist(), kept)
        tally.ce_sum += float(out.ce)
        tally.sequences += 1
    tally.correct, tally.count = correct.tolist(), count.tolist()
    return tally


def teacher_forced(drafter: DFlashDrafter, embed_tokens: torch.nn.Module, lm_head: torch.nn.Module,
                   sequences: list[tuple[list[int], list[int], int]], features_of: FeaturesOf) -> TeacherForced:
    return teacher_forced_tally(drafter, embed_tokens, lm_head, sequences, features_of).summary()


@dataclass
class EvalTally:
    """What judging one drafter on some prompts counted: sums and lists that add up exactly over the
    ranks that shared the prompts out (dflash/eval/spread.py); report() turns them into the figures."""

    dtype: str
    decoder: str
    teacher: TeacherForcedTally
    block_size: int
    prompts: int = 0
    accepted: list[int] = field(default_factory=list)  # accepted drafts per speculative cycle
    greedy_seconds: float = 0.0
    speculative_seconds: float = 0.0
    tokens: int = 0
    diverged: int = 0

    def __add__(self, other: EvalTally) -> EvalTally:
        return EvalTally(self.dtype, self.decoder, self.teacher + other.teacher, self.block_size,
                         self.prompts + other.prompts, self.accepted + other.accepted,
                         self.greedy_seconds + other.greedy_seconds,
                         self.speculative_seconds + other.speculative_seconds, self.tokens + other.tokens,
                         self.diverged + other.diverged)

    @classmethod
    def from_dict(cls, values: dict) -> EvalTally:
        return cls(**{**values, "teacher": TeacherForcedTally(**values["teacher"])})

    def report(self) -> EvalReport:
        accepted = torch.tensor(self.accepted or [0], dtype=torch.float64)
        tf = self.teacher.summary()
        return EvalReport(
            prompts=self.prompts, tau=float(accepted.mean() + 1),
            acceptance=[float((accepted >= j).double().mean()) for j in range(1, self.block_size)],
            speedup=self.greedy_seconds / max(self.speculative_seconds, 1e-9), greedy_seconds=self.greedy_seconds,
            speculative_seconds=self.speculative_seconds, tokens=self.tokens, diverged=self.diverged,
            dtype=self.dtype, decoder=self.decoder, teacher_forced_acc=tf.acc, teacher_forced_streak=tf.streak,
            teacher_forced_eal=tf.eal, teacher_forced_tau=tf.tau)


def evaluate_tally(target: FrozenTarget, drafter: DFlashDrafter, prompts: list[list[int]], max_new_tokens: int,
                   eos_ids: set[int], decoder: str = "auto", continuations: dict | None = None,
                   on_prompt: Callable[[], None] = lambda: None, decoders: dict | None = None) -> EvalTally:
    """Greedy against speculative decoding of each prompt, and the teacher-forced counts on the
    target's continuations. `continuations`: a dict that keeps those per block size and length, so
    that the drafters judged on one target and prompts share them (they take a greedy decode each);
    `on_prompt`: called as each prompt is decoded (a sign of life for whoever waits); `decoders`: a
    dict that keeps each drafter's Decoder, so that judging it again at a length its caches hold
    reuses its compiled steps and captured graphs."""
    drafter = drafter.to(target.device, target.embed_tokens.weight.dtype).eval()
    kind = resolve_decoder(decoder, target)
    block = drafter.block_size
    dtype = str(target.embed_tokens.weight.dtype).removeprefix("torch.")
    started = time.perf_counter()
    decode = reusable_decoder(target, drafter, max(map(len, prompts)) + max_new_tokens + block, kind,
                              {} if decoders is None else decoders)
    decode.greedy(prompts[0], 4, eos_ids)  # warm-up: first calls pay one-off costs (and capture graphs)
    decode.speculative(prompts[0], 4, eos_ids)
    logger.info("decoder ready in %.1f s (compiling its steps and capturing graphs the first time)",
                time.perf_counter() - started)
    tally = EvalTally(dtype, kind, TeacherForcedTally([0.0] * block, [0.0] * block), block, prompts=len(prompts))
    replies = []
    for prompt in prompts:
        plain = decode.greedy(prompt, max_new_tokens, eos_ids)
        replies.append(plain.tokens)
        spec = decode.speculative(prompt, max_new_tokens, eos_ids)
        if spec.tokens != plain.tokens:
            tally.diverged += 1
            # a bug in float32; in bfloat16 a near-tie rounded two ways (check_lossless sums them up)
            (logger.error if dtype == "float32" else logger.info)(
                "speculative output differs from greedy on a prompt of %d tokens", len(prompt))
        tally.greedy_seconds += plain.seconds
        tally.speculative_seconds += spec.seconds
        tally.accepted += spec.accepted
        tally.tokens += len(spec.tokens)
        on_prompt()
    continuations = {} if continuations is None else continuations
    if (block, max_new_tokens) not in continuations:
        continuations[block, max_new_tokens] = [(p, *continuation(decode, p, max_new_tokens, eos_ids, block, reply))
                                                for p, reply in zip(prompts, replies)]
    tally.teacher = teacher_forced_tally(drafter, target.embed_tokens, target.lm_head,
                                         continuations[block, max_new_tokens], target_features(target))
    return tally


def reusable_decoder(target: FrozenTarget, drafter: DFlashDrafter, capacity: int, kind: str, decoders: dict) -> Decoder:
    """The Decoder `decoders` keeps for this drafter, where its caches hold `capacity` positions;
    else a new one, kept there."""
    kept = decoders.get((drafter, kind))
    if kept is None or kept.capacity < capacity:
        kept = decoders[drafter, kind] = Decoder(target, drafter, capacity, kind)
    return kept


def evaluate(target: FrozenTarget, drafter: DFlashDrafter, prompts: list[list[int]], max_new_tokens: int,
             eos_ids: set[int], decoder: str = "auto", continuations: dict | None = None,
             decoders: dict | None = None) -> EvalReport:
    """evaluate_tally's figures."""
    return evaluate_tally(target, drafter, prompts, max_new_tokens, eos_ids, decoder, continuations,
                          decoders=decoders).report()


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


def resolve_dtype(flag: str, device: torch.device) -> str:
    """--eval-dtype / --dtype auto: bfloat16, as a GPU serves, on CUDA; float32 on the CPU, where
    bfloat16 matmuls are slow and a speed-up in them means nothing."""
    if flag != "auto":
        return flag
    return "bfloat16" if device.type == "cuda" else "float32"


@dataclass(frozen=True)
class EvalRequest:
    """What an evaluation judges the drafters on: the target and its tokenizer, the first
    `num_prompts` prompts of a chat file (rendered in the `thinking` mode, --thinking, unresolved),
    decoded to `max_new_tokens` in `dtype` by `decoder`."""

    target: str
    tokenizer: str
    prompts: str
    num_prompts: int
    max_new_tokens: int
    dtype: str = "float32"
    decoder: str = "auto"
    thinking: str = "auto"


def tally_drafters(request: EvalRequest, drafters: dict[str, str | Path], device: torch.device,
                   share: tuple[int, int] = (0, 1), on_prompt: Callable[[], None] = lambda: None
                   ) -> dict[str, EvalTally]:
    """Load the target once and judge each named drafter folder on the same prompts (`share` (i, k):
    the i-th of every k of them); a drafter that records another thinking mode is refused."""
    return Judging.load(request, drafters, device, share).tally(request.max_new_tokens, on_prompt)


@dataclass
class Judging:
    """A target, prompts and drafters loaded once, to judge the drafters at one length or several:
    the target's continuations and each drafter's Decoder are kept between lengths."""

    request: EvalRequest
    target: FrozenTarget
    prompts: list[list[int]]
    drafters: dict[str, DFlashDrafter]
    eos: set[int]
    continuations: dict = field(default_factory=dict)
    decoders: dict = field(default_factory=dict)

    @classmethod
    def load(cls, request: EvalRequest, drafters: dict[str, str | Path], device: torch.device,
             share: tuple[int, int] = (0, 1)) -> Judging:
        tokenizer = load_tokenizer(request.tokenizer)
        mode = resolve_thinking(tokenizer, request.thinking)
        prompts = load_prompts(request.prompts, tokenizer, request.num_prompts, mode)  # cheap checks before the target
        prompts = prompts[share[0]::share[1]]
        loaded = {name: load_drafter(path) for name, path in drafters.items()}
        for name, drafter in loaded.items():
            trained = drafter.config.dflash_config.get("thinking")  # None: exported before drafters recorded it
            if trained is not None and trained != mode:
                raise mismatch_error(trained, f"--drafter {drafters[name]} (dflash_config in its config.json)", mode,
                                     "the drafter")
        layer_ids = {tuple(d.config.dflash_config["target_layer_ids"]) for d in loaded.values()}
        if len(layer_ids) != 1:
            raise DrafterLoadError(f"drafters {list(drafters)} read different target layers {sorted(layer_ids)}")
        target = FrozenTarget.load(resolve_target(request.target), list(layer_ids.pop()), getattr(torch, request.dtype),
                                   device)
        return cls(request, target, prompts, loaded, eos_token_ids(tokenizer, target))

    def tally(self, max_new_tokens: int, on_prompt: Callable[[], None] = lambda: None) -> dict[str, EvalTally]:
        return {name: evaluate_tally(self.target, drafter, self.prompts, max_new_tokens, self.eos, self.request.decoder,
                                     self.continuations, on_prompt, self.decoders)
                for name, drafter in self.drafters.items()}


def evaluate_drafters(request: EvalRequest, drafters: dict[str, str | Path], device: torch.device,
                      lengths: list[int] | None = None) -> dict[int, dict[str, EvalReport]]:
    """The figures of each drafter at each of `lengths` new tokens a prompt (default: the request's
    max_new_tokens), each logged. One process judges them all: the target loads once, and the
    longest length first makes the decoders that the shorter ones reuse."""
    started = time.perf_counter()
    judging = Judging.load(request, drafters, device)
    logger.info("target and drafters loaded in %.1f s", time.perf_counter() - started)
    reports = {}
    for length in sorted(set(lengths or [request.max_new_tokens]), reverse=True):
        started = time.perf_counter()
        reports[length] = {name: tally.report() for name, tally in judging.tally(length).items()}
        for name, report in reports[length].items():
            logger.info("eval %s, at most %d new tokens (%.1f s): %s", name, length, time.perf_counter() - started,
                        report.summary())
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
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({k: {**asdict(v), "lossless": v.lossless,
                                          "greedy_tokens_per_second": v.greedy_tokens_per_second,
                                          "speculative_tokens_per_second": v.speculative_tokens_per_second}
                                      for k, v in reports.items()}, indent=2) + "\n")
