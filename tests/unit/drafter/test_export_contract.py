"""The exported config read the way serving engines read it, key by key: every reading of the
layer ids must name the target layers whose outputs the drafter was trained on.

Contracts (as the engines document and implement them):
  vLLM    `eagle_aux_hidden_state_layer_ids` if present, taken as is; otherwise
          `dflash_config.target_layer_ids` + 1. Ids index the hidden-state list whose entry 0
          is the embedding output (HF `output_hidden_states`).
  SGLang  `dflash_config.target_layer_ids`, captured before decoder layer id + 1 (the residual
          stream entering that layer), i.e. the same HF `hidden_states[id + 1]`.
  both    `dflash_config.mask_token_id`; the block size from `dflash_config.block_size` or the
          top-level `block_size`; `num_hidden_layers` drafter layers.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import MASK_ID, tiny_drafter, tiny_target
from dflash.drafter.export import export_drafter


def vllm_hidden_state_ids(config: dict) -> list[int]:
    if "eagle_aux_hidden_state_layer_ids" in config:
        return list(config["eagle_aux_hidden_state_layer_ids"])
    return [i + 1 for i in config["dflash_config"]["target_layer_ids"]]


def sglang_hidden_state_ids(config: dict) -> list[int]:
    return [i + 1 for i in config["dflash_config"]["target_layer_ids"]]  # input of layer i + 1


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("reader", [vllm_hidden_state_ids, sglang_hidden_state_ids], ids=["vllm", "sglang"])
def test_engines_resolve_the_trained_layers(tmp_path, arch, reader):
    target = tiny_target(arch, dtype=torch.float32)
    drafter = tiny_drafter(target, block_size=8, num_layers=2).float()
    config = json.loads((export_drafter(drafter, tmp_path / "drafter", torch.float32) / "config.json").read_text())
    ids = torch.tensor([[5, 9, 2, 7, 11, 3, 4, 8]])
    with torch.no_grad():
        hidden = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    trained_on = target.features(ids).features  # what training fed the drafter
    engine_view = torch.cat([hidden[i] for i in reader(config)], dim=-1)
    torch.testing.assert_close(engine_view, trained_on, rtol=0, atol=0)
    # the other fields each engine reads
    assert config["dflash_config"]["mask_token_id"] == MASK_ID
    assert config["dflash_config"]["block_size"] == config["block_size"] == 8
    assert config["num_hidden_layers"] == 2 and config["architectures"] == ["DFlashDraftModel"]


def test_the_older_vllm_reading_without_the_eagle_key_agrees(tmp_path):
    target = tiny_target("qwen3", dtype=torch.float32)
    config = json.loads((export_drafter(tiny_drafter(target).float(), tmp_path / "d", torch.float32)
                         / "config.json").read_text())
    legacy = {k: v for k, v in config.items() if k != "eagle_aux_hidden_state_layer_ids"}
    assert vllm_hidden_state_ids(legacy) == vllm_hidden_state_ids(config) == sglang_hidden_state_ids(config)


def test_a_sliding_window_drafter_exports_the_window_keys_and_loads_back(tmp_path):
    """Engines read `layer_types` + `sliding_window` (HF style) or `dflash_config.use_swa` +
    `swa_window_size`; our own loader must get the same window back."""
    from dflash.drafter.export import load_drafter

    target = tiny_target("qwen3", dtype=torch.float32)
    folder = export_drafter(tiny_drafter(target, window=24).float(), tmp_path / "d", torch.float32)
    config = json.loads((folder / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention"] * config["num_hidden_layers"]
    assert config["sliding_window"] == 24 and config["use_sliding_window"] is True
    assert config["dflash_config"]["use_swa"] is True and config["dflash_config"]["swa_window_size"] == 24
    assert load_drafter(folder).window == 24
    full = json.loads((export_drafter(tiny_drafter(target).float(), tmp_path / "f", torch.float32)
                       / "config.json").read_text())
    assert "use_swa" not in full["dflash_config"] and set(full["layer_types"]) == {"full_attention"}
