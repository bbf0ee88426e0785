"""Sampling a target's next token the way HF generation does (temperature, then top-k, then
top-p), written without host synchronisation so that it runs inside a captured CUDA graph: the
static-cache engine regenerates with `--sampling target` at its greedy speed.

The draw is Gumbel-max: argmax(scores + G) with G = -log(-log U), U uniform, picks token i with
probability softmax(scores)_i; a top-p of 0.97 or more over the whole vocabulary draws by inverse
CDF and rejection instead (REJECTION_ROUNDS). On CUDA, random ops in a graph draw new numbers at
every replay."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash.target.frozen import TargetError

# What HF generation samples with where a generation config leaves a setting unset.
HF_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
# top-p over a whole vocabulary without sorting it (a sort of rows x 151,936 scores costs a batched
# step more than the rest of the sampling: on a 2-core CPU, 2.8 s against 0.6 for 256 rows): draws
# from the full distribution, by its cumulative sum, and one inside the nucleus is kept. A token is
# inside when the tokens more likely than it hold less than top_p of the mass; rejecting the draws
# outside leaves a kept draw distributed as the nucleus. Taken where REJECTION_ROUNDS draws at most
# leave under REJECTION_MISS of the tokens to the most likely one (top_p >= 0.97); lower top_p sorts.
REJECTION_ROUNDS, REJECTION_MISS = 4, 1e-6

# Generation-config fields whose non-default values HF applies and this sampler does not.
UNSUPPORTED = {"repetition_penalty": 1.0, "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0,
               "eta_cutoff": 0.0, "no_repeat_ngram_size": 0, "encoder_repetition_penalty": 1.0}


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_k: int = 0  # 0: every token
    top_p: float = 1.0

    @staticmethod
    def of(generation_config) -> "Sampling":
        """The target's own settings (its generation_config.json, HF's defaults where it is silent);
        settings this sampler does not implement are refused, not ignored."""
        used = {name: getattr(generation_config, name, default) for name, default in UNSUPPORTED.items()}
        unsupported = {name: value for name, value in used.items() if value not in (None, UNSUPPORTED[name])}
        if unsupported:
            raise TargetError(f"the target's generation_config sets {unsupported}, which the fast engine does not "
                              "apply; use --engine hf (or vllm) for --sampling target")
        def setting(name: str):  # unset: HF generation's own default
            value = getattr(generation_config, name, None)
            return HF_DEFAULTS[name] if value is None else value

        sampling = Sampling(float(setting("temperature")), int(setting("top_k")), float(setting("top_p")))
        if sampling.temperature <= 0 or not 0 < sampling.top_p <= 1 or sampling.top_k < 0:
            raise TargetError(f"the target's generation_config has {sampling}: sampling needs temperature > 0, "
                              "0 < top_p <= 1 and top_k >= 0")
        return sampling

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """Token ids [...] drawn from logits [..., V]."""
        scores = logits.float() / self.temperature
        if not self.top_k and self.top_p < 1 and self._rejection_rounds() <= REJECTION_ROUNDS:
            return self._nucleus_by_rejection(scores)
        ids = None
        if self.top_k:
            scores, ids = scores.topk(min(self.top_k, scores.shape[-1]), dim=-1)  # sorted, largest first
        elif self.top_p < 1:
            scores, ids = scores.sort(dim=-1, descending=True)
        if self.top_p < 1:  # keep the most likely tokens until their mass reaches top_p (the first always)
            probs = scores.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs
            scores = scores.masked_fill(before >= self.top_p, float("-inf"))
        uniform = torch.rand_like(scores).clamp_(min=1e-20)
        pick = (scores - torch.log(-torch.log(uniform))).argmax(dim=-1, keepdim=True)
        return pick.squeeze(-1) if ids is None else ids.gather(-1, pick).squeeze(-1)

    def _rejection_rounds(self) -> int:
        return math.ceil(math.log(REJECTION_MISS) / math.log(1 - self.top_p))

    def _nucleus_by_rejection(self, scores: torch.Tensor) -> torch.Tensor:
        probs = scores.softmax(dim=-1)
        cdf = probs.double().cumsum(dim=-1)  # one pass for every round's draw (inverse CDF)
        pick = scores.argmax(dim=-1)  # inside every nucleus: where every draw was rejected
        for _ in range(self._rejection_rounds()):
            uniform = torch.rand(cdf.shape[:-1] + (1,), dtype=cdf.dtype, device=cdf.device) * cdf[..., -1:]
            draw = torch.searchsorted(cdf, uniform, right=True).clamp_(max=cdf.shape[-1] - 1)
            above = probs.masked_fill(probs <= probs.gather(-1, draw), 0).sum(dim=-1)  # mass of the likelier tokens
            pick = torch.where(above < self.top_p, draw.squeeze(-1), pick)
        return pick
