"""Export the drafter as an HF folder the public DFlash loaders read, and load it back.

config.json: a Qwen3 config (num_hidden_layers = drafter layers) plus
  architectures ["DFlashDraftModel"], block_size, num_target_layers,
  dflash_config {mask_token_id, target_layer_ids, block_size}, and
  eagle_aux_hidden_state_layer_ids (target_layer_ids + 1, the form vLLM takes as is).
Layer ids: target layer id i is the OUTPUT of decoder layer i, which is HF `hidden_states[i + 1]`
(`hidden_states[0]` is the embedding output) and the input of layer i + 1.
model.safetensors: top-level names (`layers.N.self_attn.q_proj.weight`, `fc.weight`,
  `hidden_norm.weight`, `norm.weight`, ...); no embedding, no lm_head (they are the target's).
  With a draft vocabulary (dflash_config.draft_vocab_size N): `draft_to_target`, the N target
  token ids (int64, ascending) whose lm_head rows the drafter drafts from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from dflash.drafter.model import DFlashDrafter
from dflash.util.files import replace_dir, staging_dir, storage_error

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DFLASH_FIELDS = ("block_size", "num_target_layers", "dflash_config")


def exported_config(drafter: DFlashDrafter) -> dict:
    config = drafter.config.to_dict()
    rope = config.get("rope_parameters") or {}
    # Loaders built on older transformers read rope_theta / rope_scaling directly.
    config["rope_theta"] = rope.get("rope_theta", 10000.0)
    config["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    # vLLM reads this key as is (older builds read only it) and otherwise adds 1 to
    # dflash_config.target_layer_ids: both say "the output of target layer i" = hidden_states[i + 1]
    config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in drafter.config.dflash_config["target_layer_ids"]]
    # some loaders read the block size from dflash_config, others from the top level
    config["dflash_config"] = {**drafter.config.dflash_config, "block_size": drafter.config.block_size}
    config["architectures"] = ["DFlashDraftModel"]
    config["model_type"] = "qwen3"
    config["dtype"] = str(next(drafter.parameters()).dtype).removeprefix("torch.")
    return config


def export_drafter(drafter: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json + model.safetensors into a staging folder, then move it into place;
    an earlier export stays until the new one is complete. Raises StorageError naming the path
    when the disk is full or not writable."""
    out_dir = Path(out_dir)
    state = {name: tensor.detach().to("cpu", dtype if tensor.is_floating_point() else tensor.dtype).contiguous()
             for name, tensor in drafter.state_dict().items()}  # ids (the draft vocabulary) stay ids
    config = exported_config(drafter)
    config["dtype"] = str(dtype).removeprefix("torch.")
    intact = f"the earlier {out_dir} (if any) is intact"
    try:
        staging = staging_dir(out_dir)
    except OSError as err:
        raise storage_error(err, out_dir, intact) from err
    try:
        save_file(state, staging / WEIGHTS_NAME, metadata={"format": "pt"})
        (staging / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        replace_dir(staging, out_dir)
    except OSError as err:
        raise storage_error(err, out_dir, intact) from err
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already after a successful move
    return out_dir


class DrafterLoadError(ValueError):
    """An exported drafter folder that cannot be loaded; the message names the file."""


def load_drafter(path: str | Path, dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Load an exported drafter folder (ours or any with the same names)."""
    path = Path(path)
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise DrafterLoadError(f"--drafter {path}: no {CONFIG_NAME}; pass a folder written by the export step")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise DrafterLoadError(f"{config_file}: not readable JSON ({err}); export the drafter again") from err
    missing = [name for name in DFLASH_FIELDS if name not in raw]
    if missing:
        raise DrafterLoadError(f"{config_file}: not a DFlash drafter config (missing {missing})")
    extras = {name: raw.pop(name) for name in DFLASH_FIELDS}
    extras["dflash_config"] = {k: v for k, v in extras["dflash_config"].items() if k != "block_size"}  # a copy
    for legacy in ("rope_theta", "rope_scaling", "eagle_aux_hidden_state_layer_ids"):  # derived on export
        raw.pop(legacy, None)
    try:
        config = Qwen3Config(**raw)
        for name, value in extras.items():
            setattr(config, name, value)
        drafter = DFlashDrafter(config)
    except Exception as err:
        raise DrafterLoadError(f"{config_file}: cannot build a drafter from it ({err})") from err
    weights = path / WEIGHTS_NAME
    try:
        state = load_file(weights)
    except Exception as err:  # missing, truncated or corrupt file
        raise DrafterLoadError(f"{weights}: cannot read the weights ({err}); export the drafter again") from err
    try:
        drafter.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise DrafterLoadError(f"{weights}: the weights do not fit {CONFIG_NAME} ({err})") from err
    return drafter.to(dtype) if dtype is not None else drafter
