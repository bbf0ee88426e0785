"""The static-cache engine's sampler draws from the distribution HF generation samples from
(temperature, then top-k, then top-p), and refuses settings it does not apply."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from dflash.target.frozen import TargetError
from dflash.target.sampling import Sampling


def hf_probabilities(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    scores = logits[None].clone()
    if sampling.temperature != 1.0:
        scores = TemperatureLogitsWarper(sampling.temperature)(None, scores)
    if sampling.top_k:
        scores = TopKLogitsWarper(sampling.top_k)(None, scores)
    if sampling.top_p < 1.0:
        scores = TopPLogitsWarper(sampling.top_p)(None, scores)
    return scores.softmax(-1)[0]


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(0.7, 5), Sampling(1.3, 0, 0.8), Sampling(0.8, 6, 0.9),
                                      Sampling(1.0, 0, 0.99), Sampling(1.3, 0, 0.97)], ids=str)
def test_draws_follow_hf_generations_distribution(sampling):
    """Top-p of 0.97 and more over the whole vocabulary is drawn by rejection, lower top-p by sorting."""
    torch.manual_seed(0)
    logits = torch.randn(12) * 2
    want = hf_probabilities(logits, sampling)
    draws = sampling.choose(logits.expand(40_000, -1))
    got = torch.bincount(draws, minlength=12).double() / draws.numel()
    assert (got - want).abs().max() < 0.01, (got, want)  # 4 standard deviations at 40K draws
    assert bool(((want == 0) <= (got == 0)).all()), "a token HF removes is never drawn"


def test_one_token_left_is_greedy_and_batches_draw_per_row():
    logits = torch.randn(3, 7, 50)
    assert torch.equal(Sampling(top_k=1).choose(logits), logits.argmax(-1))
    assert torch.equal(Sampling(top_p=1e-6).choose(logits), logits.argmax(-1))
    same_row = Sampling().choose(torch.zeros(1000, 50))
    assert len(set(same_row.tolist())) > 30, "rows draw independently"


def test_settings_come_from_the_generation_config_and_unsupported_ones_are_refused():
    assert Sampling.of(GenerationConfig()) == Sampling(1.0, 50, 1.0)  # HF's defaults
    assert Sampling.of(GenerationConfig(temperature=0.6, top_p=0.95, top_k=20)) == Sampling(0.6, 20, 0.95)
    with pytest.raises(TargetError, match="repetition_penalty.*--engine hf"):
        Sampling.of(GenerationConfig(repetition_penalty=1.2))
