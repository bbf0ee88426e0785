"""Tiny random-weight targets and drafters built from configs (nothing is downloaded)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash.model import DFlashDrafter, drafter_config
from dflash.target import FrozenTarget, default_target_layer_ids

VOCAB = 97
MASK_ID = VOCAB - 1  # an id the random target rarely emits; the real rule is tested elsewhere


def tiny_causal_lm(arch: str = "qwen3", vocab_size: int = VOCAB, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    )
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(arch)
    return model.eval()


def tiny_target(arch: str = "qwen3", dtype: torch.dtype = torch.float64, seed: int = 0) -> FrozenTarget:
    model = tiny_causal_lm(arch, seed=seed).to(dtype)
    return FrozenTarget(model, default_target_layer_ids(model.config.num_hidden_layers, 3))


def tiny_drafter(target: FrozenTarget, block_size: int = 4, num_layers: int = 2, seed: int = 1) -> DFlashDrafter:
    torch.manual_seed(seed)
    config = drafter_config(target.model.config, num_layers, target.layer_ids, block_size, MASK_ID)
    return DFlashDrafter(config).to(target.embed_tokens.weight.dtype)


@pytest.fixture(params=["qwen3", "llama"])
def arch(request) -> str:
    return request.param
