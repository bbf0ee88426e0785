"""The frozen target: any HF causal LM whose decoder layers can be hooked.

We take the outputs of K chosen decoder layers with forward hooks (never all hidden states),
and stop the forward after the deepest of them when nothing later is needed.
Layer id `l` means the OUTPUT of decoder layer `l` (HF `hidden_states[l + 1]`).
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoConfig, AutoModelForCausalLM

from dflash.util.runtime import allow_compiled_variants

# Attention backends for forwards of a new shape each (training's micro-batches, each decoding
# step's key length): cuDNN's builds an execution plan for every new shape before its first kernel
# (on an H100: HF's own decoding took 41 ms a token against 14.5 without cuDNN, a 32,768-token forward
# of a new shape 98 ms against 65; BENCHMARKS.md "Qwen2.5-Coder-0.5B"); flash attention plans nothing.
SHAPE_FREE_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class TargetError(ValueError):
    """A target model that cannot be used, with what to do about it."""


def default_target_layer_ids(num_layers: int, num_features: int) -> list[int]:
    """`num_features` layer ids spaced uniformly from 1 to num_layers-3 (e.g. 36 layers, 5
    features -> [1, 9, 17, 25, 33]; one feature -> the middle of that span, [17]); shallow
    targets fall back to the whole depth."""
    if num_features < 1 or num_features > num_layers:
        raise TargetError(
            f"--num-target-features {num_features}: the target has {num_layers} layers; "
            f"pick 1..{num_layers} or pass --target-layer-ids explicitly"
        )
    for first, last in ((1, num_layers - 3), (0, num_layers - 1)):
        if last >= first:
            if num_features == 1:
                return [round((first + last) / 2)]
            ids = torch.linspace(first, last, num_features).round().long().tolist()
            if len(set(ids)) == num_features:
                return ids
    return list(range(num_features))


def check_target_layer_ids(layer_ids: list[int], num_layers: int) -> None:
    if not layer_ids or any(not 0 <= i < num_layers for i in layer_ids) or len(set(layer_ids)) != len(layer_ids):
        raise TargetError(
            f"--target-layer-ids {layer_ids}: need distinct ids in [0, {num_layers - 1}] "
            f"(the target has {num_layers} decoder layers)"
        )


def load_target_config(path: str):
    """The target's config, read without touching the weights (for early checks)."""
    if not Path(path).exists():
        raise TargetError(f"--target {path}: no such directory; pass a local HF model folder")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise TargetError(f"--target {path}: cannot read an HF config there ({err})") from err
    check_target_family(config, path)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


# What the drafter takes from the target's config: its width, heads and vocabulary.
REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size")


def check_target_family(config, path: str) -> None:
    """Refuse, before any weight loads, a model family DFlash cannot serve: encoder-decoders
    (no causal decoder to verify with) and configs without the decoder shapes the drafter copies."""
    name = getattr(config, "model_type", type(config).__name__)
    if getattr(config, "is_encoder_decoder", False):
        raise TargetError(f"--target {path}: {name} is an encoder-decoder model; DFlash drafts for decoder-only "
                          "causal LMs (Qwen3, Llama, Mistral, Gemma, Phi, OLMo, ...)")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    missing = [f for f in REQUIRED_FIELDS if getattr(text, f, None) is None]
    if missing:
        raise TargetError(f"--target {path}: the {name} config has no {', '.join(missing)}; DFlash needs a "
                          "decoder-only causal LM whose config names its hidden size, MLP width, heads, layers "
                          "and vocabulary (a Llama-style decoder: Qwen3, Llama, Mistral, Gemma, Phi, OLMo, ...)")


class _StopForward(Exception):
    """Raised by the deepest feature hook: the rest of the target is not needed."""


@dataclass
class TargetOutputs:
    features: torch.Tensor  # [b, S, K*D] outputs of the K feature layers, concatenated
    final_hidden: torch.Tensor | None = None  # [b, S, D] final normed hidden (for distillation)
    logits: torch.Tensor | None = None  # [b, S, V] only when asked (decoding)


class FrozenTarget:
    """A frozen HF causal LM with feature capture; also lends its embedding and lm_head."""

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        self.model = model.eval().requires_grad_(False)
        self.decoder = model.base_model
        self.layers = self._decoder_layers()
        check_target_layer_ids(layer_ids, len(self.layers))
        self.layer_ids = list(layer_ids)
        self.embed_tokens = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        self.attention_backends = SHAPE_FREE_SDPA  # of features() and decode_step (benchmarks.target_forward)
        # features() through another forward of the same weights (dflash.target.layer_features), or HF's
        self.layer_forward: Callable[[torch.Tensor, bool], tuple[dict[int, torch.Tensor], torch.Tensor | None]] | None = None
        # features() of rows packed into one sequence, given their lengths (dflash.target.packed)
        self.packed_forward: Callable[[torch.Tensor, torch.Tensor, bool], TargetOutputs] | None = None
        params = inspect.signature(model.forward).parameters
        # transformers renamed `past_key_values` to `cache` in 5.2x; accept both versions.
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @classmethod
    def load(cls, path: str, layer_ids: list[int], dtype: torch.dtype, device: torch.device) -> "FrozenTarget":
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        except Exception as err:  # transformers and safetensors raise many kinds for a bad folder
            raise TargetError(f"--target {path}: cannot load a causal LM ({type(err).__name__}: {err}); "
                              f"{_weights_hint(Path(path))}") from err
        return cls(model.to(device), layer_ids)

    @staticmethod
    def load_embedding_and_head(path: str, dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, nn.Module]:
        """Only the input embedding and lm_head (tied or not), read straight from the
        safetensors files: a split-mode drafter rank needs these two, not the whole target."""
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        names: dict[int, list[str]] = {}
        for name, param in skeleton.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        embed_names = names[id(skeleton.get_input_embeddings().weight)]
        head_names = names[id(skeleton.get_output_embeddings().weight)]
        tensors = read_safetensors(Path(path), set(embed_names) | set(head_names))
        # Tied weights are one parameter under several names, stored once under any of them.
        embed_weight = next(tensors[n] for n in embed_names + head_names if n in tensors)
        head_weight = next(tensors[n] for n in head_names + embed_names if n in tensors)
        embed = nn.Embedding.from_pretrained(embed_weight.to(device, dtype), freeze=True)
        head = nn.Linear(head_weight.shape[1], head_weight.shape[0], bias=False, device=device, dtype=dtype)
        head.weight.data.copy_(head_weight)
        return embed, head.requires_grad_(False)

    def _decoder_layers(self) -> nn.ModuleList:
        layers = getattr(self.decoder, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise TargetError(
                f"{type(self.model).__name__}: its decoder has no `layers` list to hook; "
                "DFlash needs a decoder-only model like Qwen3 or Llama"
            )
        return layers

    def compile_pointwise(self) -> None:
        """Compile each decoder layer's MLP and RMS norms: eager, their float32 casts and SiLU
        are a large share of the target forward's GPU time. Attention and the KV cache stay
        eager, so decoding over a cache is untouched. Dynamic: every micro-batch has its length."""
        allow_compiled_variants()
        for layer in self.layers:
            for name, module in layer.named_modules():
                if name == "mlp" or type(module).__name__.endswith("RMSNorm"):
                    module.compile(dynamic=True)

    @property
    def hidden_size(self) -> int:
        return self.embed_tokens.weight.shape[1]

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @contextlib.contextmanager
    def _capture(self, stop_after_deepest: bool):
        captured: dict[int, torch.Tensor] = {}
        deepest = max(self.layer_ids)

        def hook_for(layer_id: int):
            def hook(module, args, output):
                captured[layer_id] = output[0] if isinstance(output, tuple) else output
                if stop_after_deepest and layer_id == deepest:
                    raise _StopForward

            return hook

        handles = [self.layers[i].register_forward_hook(hook_for(i)) for i in self.layer_ids]
        try:
            yield captured
        finally:
            for handle in handles:
                handle.remove()

    def stack_features(self, captured: dict[int, torch.Tensor]) -> torch.Tensor:
        return torch.cat([captured[i] for i in self.layer_ids], dim=-1)

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, with_final_hidden: bool = False,
                 lengths: torch.Tensor | None = None) -> TargetOutputs:
        """Features of every position of right-padded `input_ids` [b, S]. Causal attention means
        real tokens never see the padding after them, so no attention mask is needed. `lengths`
        (the rows' real tokens, on the host): with a packed forward, only those are computed."""
        if lengths is not None and self.packed_forward is not None:
            return self.packed_forward(input_ids, lengths, with_final_hidden)
        captured, final = self.layer_outputs(input_ids, with_final_hidden)
        return TargetOutputs(features=self.stack_features(captured), final_hidden=final)

    @torch.no_grad()
    def features_by_length(self, groups: list[tuple[torch.Tensor, torch.Tensor]], batch_shape: tuple[int, int],
                           with_final_hidden: bool = False) -> TargetOutputs:
        """features() of a right-padded [b, S] batch, run group by group (dflash/target/length_groups.py):
        `groups` holds each group's ids [rows, width], cut to its longest row, and its rows' indices in
        the batch. A row's positions past its group's width come back as zeros: they are padding,
        which no block attends to."""
        b, s = batch_shape
        features = final = None
        for ids, rows in groups:
            captured, last = self.layer_outputs(ids, with_final_hidden)
            width, hidden = ids.shape[1], captured[self.layer_ids[0]].shape[-1]
            if features is None:
                features = captured[self.layer_ids[0]].new_zeros(b, s, len(self.layer_ids) * hidden)
                final = last.new_zeros(b, s, hidden) if last is not None else None
            for k, layer_id in enumerate(self.layer_ids):  # straight into place: no concatenated copy
                features[:, :width, k * hidden:(k + 1) * hidden].index_copy_(0, rows, captured[layer_id])
            if final is not None:
                final[:, :width].index_copy_(0, rows, last)
        return TargetOutputs(features=features, final_hidden=final)

    def layer_outputs(self, input_ids: torch.Tensor, with_final_hidden: bool,
                      **model_kwargs) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
        """The feature layers' outputs by layer id, and the final normed hidden state when asked;
        `model_kwargs` go to HF's forward (the packed forward's positions and row bounds)."""
        if self.layer_forward is not None:
            return self.layer_forward(input_ids, with_final_hidden)
        with self._capture(stop_after_deepest=not with_final_hidden) as captured, sdpa_kernel(self.attention_backends):
            try:
                out = self.decoder(input_ids=input_ids, use_cache=False, **model_kwargs)
            except _StopForward:
                out = None
        return captured, (out.last_hidden_state if out is not None else None)

    @torch.no_grad()
    def decode_step(self, input_ids: torch.Tensor, cache) -> TargetOutputs:
        """Forward of new tokens [b, T] over a KV cache (mutated): logits and features."""
        start = cache.get_seq_length()
        positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)[None]
        # a new key length every step: the same new shape each time as in features()
        with self._capture(stop_after_deepest=False) as captured, sdpa_kernel(self.attention_backends):
            out = self.model(
                input_ids=input_ids, position_ids=positions, use_cache=True, **{self._cache_kwarg: cache}
            )
        return TargetOutputs(features=self.stack_features(captured), logits=out.logits)

    @staticmethod
    def crop_cache(cache, length: int) -> None:
        """Drop cached positions >= length (negative crop means "remove", in every version)."""
        extra = cache.get_seq_length() - length
        if extra > 0:
            cache.crop(-extra)


def resolve_mask_token_id(tokenizer, target_config, requested: int | None) -> int:
    """The block's MASK id: --mask-token-id, else the tokenizer's mask token, else a spare
    embedding row (spare_row), else an error."""
    rows = target_config.vocab_size
    if requested is not None:
        if not 0 <= requested < rows:
            raise TargetError(f"--mask-token-id {requested}: must be an embedding row in [0, {rows - 1}]")
        check_mask_is_not_special(requested, tokenizer, target_config)
        return requested
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return tokenizer.mask_token_id
    spare = spare_row(tokenizer, rows)
    if spare is not None:
        return spare
    raise TargetError(
        f"the tokenizer uses all {rows} embedding rows of the target and has no mask token; pass "
        "--mask-token-id with the id of a token the target never emits (e.g. an unused special token)"
    )


# llama.cpp's converter lists a row that has no token as the placeholder "[PAD<row>]" (Qwen's
# rows 151665 and up), and transformers keeps it in the vocabulary of a GGUF's tokenizer
PLACEHOLDER = re.compile(r"\[PAD(\d+)\]")


def spare_row(tokenizer, rows: int) -> int | None:
    """An embedding row no token of the tokenizer names, so the target never emits it: the first
    placeholder row of a GGUF tokenizer, else the first row past the tokenizer (Qwen3's reserved
    rows); None when every row is a token."""
    placeholders = [index for token, index in tokenizer.get_vocab().items()
                    if index < rows and (match := PLACEHOLDER.fullmatch(token)) and int(match.group(1)) == index]
    if placeholders:
        return min(placeholders)
    return len(tokenizer) if len(tokenizer) < rows else None


SPECIAL_ROLES = {"eos": "end-of-sequence", "pad": "padding", "bos": "beginning-of-sequence"}


def check_mask_is_not_special(token_id: int, tokenizer, target_config) -> None:
    """The mask fills the drafter's block slots: if it is a token the target emits or sees (end of
    text, padding, start of text), the drafter reads its slots as that token, a known cause of
    low acceptance."""
    for role, meaning in SPECIAL_ROLES.items():
        in_config = getattr(target_config, f"{role}_token_id", None)  # an id, a list of ids, or None
        in_config = in_config if isinstance(in_config, list) else [in_config]
        if token_id in (getattr(tokenizer, f"{role}_token_id", None), *in_config):
            raise TargetError(
                f"--mask-token-id {token_id} is the {meaning} token {tokenizer.convert_ids_to_tokens(token_id)!r} "
                "(the drafter would read its mask slots as that token); pick an id the target never emits, "
                "e.g. an unused special token, or leave the flag out to use the tokenizer's mask token or a spare "
                "embedding row")


def _each_safetensors_file(folder: Path, visit) -> None:
    """visit(opened file) for each file of a (possibly sharded) safetensors checkpoint, in name
    order. A file that fails to open or to read inside `visit` raises a TargetError naming it:
    the usual cause is an interrupted copy."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise TargetError(f"--target {folder}: no *.safetensors weights found")
    for file in files:
        try:
            with safe_open(str(file), "pt") as f:
                visit(f)
        except Exception as err:  # safetensors' own error type for a truncated or corrupt file
            raise TargetError(f"{file} is truncated or corrupt: copy it again ({err})") from err


def _weights_hint(folder: Path) -> str:
    """Which weight file is unreadable, when one is."""
    try:
        _each_safetensors_file(folder, lambda f: f.keys())
    except TargetError as err:
        return str(err)
    return "check that the folder holds a complete HF causal-LM checkpoint"


def safetensors_names(folder: Path) -> set[str]:
    """Every tensor name in a (possibly sharded) safetensors checkpoint."""
    names: set[str] = set()
    _each_safetensors_file(folder, lambda f: names.update(f.keys()))
    return names


def read_safetensors(folder: Path, wanted: set[str]) -> dict[str, torch.Tensor]:
    """The named tensors from a (possibly sharded) safetensors checkpoint."""
    found: dict[str, torch.Tensor] = {}

    def take(f) -> None:
        for name in wanted & set(f.keys()):
            found[name] = f.get_tensor(name)

    _each_safetensors_file(folder, take)
    if not found:
        raise TargetError(f"--target {folder}: none of {sorted(wanted)} in its safetensors files")
    return found
