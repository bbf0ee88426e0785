"""A GGUF --target (dflash/target/gguf.py): de-quantized once into an HF folder that gives the
original model's logits, features, embedding and tokenizer; reused until the file changes; a
killed conversion is never reused; clear errors for two GGUFs, a corrupt file, no `gguf` package.

The GGUF is written here with the `gguf` package's writer, as llama.cpp's converter writes a
Llama: its metadata keys, its tensor names, and the row permutation of q/k it applies (which
transformers' loader undoes), so a wrong permutation or name shows as different logits.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

import dflash.target.gguf as gguf_target
from conftest import tiny_causal_lm, write_chat_jsonl
from dflash.data.tokenization import load_tokenizer, prompt_ids
from dflash.placement.distributed import RankInfo
from dflash.target.frozen import FrozenTarget, TargetError, load_target_config
from dflash.target.gguf import SOURCE_RECORD, default_cache_dir, gguf_file, resolve_target, run_target_dir
from tiny_tokenizer import make_tiny_tokenizer

LAYER_IDS = [1, 4]
MESSAGES = [{"role": "user", "content": "Hello there, how are you today?"}]


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py reorders q/k rows from HF's rotate-half layout to
    interleaved pairs (LlamaModel.permute)."""
    heads = n_head_kv if n_head_kv != n_head else n_head
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_gguf(model, tokenizer, path: Path, placeholders: gguf.TokenType | None = None) -> Path:
    """`model` (a LlamaForCausalLM) and `tokenizer` (byte-level BPE) as llama.cpp writes them, in F32.
    `placeholders`: the rows past the tokenizer are listed as "[PAD<row>]" tokens of that type, as
    llama.cpp's converter lists them for Qwen (UNUSED; older converters: USER_DEFINED)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_uint32("llama.vocab_size", cfg.vocab_size)  # more rows than tokens: spare ones, as Qwen3 has
    tokens = [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    writer.add_tokenizer_model("gpt2")
    types = [gguf.TokenType.CONTROL if t in tokenizer.all_special_tokens else gguf.TokenType.NORMAL for t in tokens]
    if placeholders is not None:
        padding = range(len(tokens), cfg.vocab_size)
        tokens, types = tokens + [f"[PAD{row}]" for row in padding], types + [placeholders] * len(padding)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(pair) for pair in merges])
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)
    state = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        hf = f"model.layers.{i}."
        for ours, theirs, groups in (("attn_q", "self_attn.q_proj", heads), ("attn_k", "self_attn.k_proj", kv_heads)):
            permuted = llama_cpp_permute(state[hf + theirs + ".weight"], heads, groups)
            writer.add_tensor(f"blk.{i}.{ours}.weight", permuted)
        for ours, theirs in (("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                             ("attn_norm", "input_layernorm"), ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
                             ("ffn_down", "mlp.down_proj"), ("ffn_norm", "post_attention_layernorm")):
            writer.add_tensor(f"blk.{i}.{ours}.weight", state[hf + theirs + ".weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if not cfg.tie_word_embeddings:  # llama.cpp leaves output.weight out of a tied model
        writer.add_tensor("output.weight", state["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_gguf(folder: Path, tied: bool = False, placeholders: gguf.TokenType | None = None,
              ) -> tuple[torch.nn.Module, Path]:
    tokenizer = make_tiny_tokenizer()
    model = tiny_causal_lm("llama", vocab_size=len(tokenizer) + 3)
    if tied:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    folder.mkdir(parents=True, exist_ok=True)
    return model, write_gguf(model, tokenizer, folder / "tiny.gguf", placeholders)


@pytest.fixture
def conversions(monkeypatch) -> list[Path]:
    """The GGUF files converted (not reused) during the test."""
    converted, convert = [], gguf_target._convert
    monkeypatch.setattr(gguf_target, "_convert",
                        lambda source, cache: (converted.append(source), convert(source, cache)))
    return converted


@pytest.mark.parametrize("tied", [False, True])
def test_the_converted_gguf_gives_the_original_logits_features_embedding_and_tokenizer(tmp_path, tied):
    model, path = tiny_gguf(tmp_path, tied)
    folder = resolve_target(path, tmp_path / "cache")
    target = FrozenTarget.load(folder, LAYER_IDS, torch.float32, torch.device("cpu"))
    original = FrozenTarget(model, LAYER_IDS)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(target.model(ids).logits, model(ids).logits, atol=1e-5)
    assert torch.allclose(target.features(ids).features, original.features(ids).features, atol=1e-5)
    embed, head = FrozenTarget.load_embedding_and_head(folder, torch.float32, torch.device("cpu"))  # split mode
    assert torch.equal(embed.weight, model.get_input_embeddings().weight)
    assert torch.equal(head.weight, model.get_output_embeddings().weight)
    assert load_target_config(folder).num_hidden_layers == model.config.num_hidden_layers
    expected = prompt_ids(make_tiny_tokenizer(), MESSAGES)
    for tokenizer in (load_tokenizer(path), load_tokenizer(folder)):  # the file's own, and the saved copy
        assert prompt_ids(tokenizer, MESSAGES) == expected
    generation = json.loads((Path(folder) / "generation_config.json").read_text())
    assert generation["eos_token_id"] == make_tiny_tokenizer().eos_token_id
    assert (Path(folder) / "model.safetensors").stat().st_mode & 0o044 == 0o044  # readable by other users


def test_a_conversion_parses_the_gguf_once(tmp_path, monkeypatch):
    """transformers reads the file for the config, the tokenizer and the tensors: one reader
    serves them all (each parses every metadata field), and gguf's own is back afterwards."""
    opened, reader = [], gguf.GGUFReader

    def counting(path, *args, **kwargs):
        opened.append(path)
        return reader(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    _, path = tiny_gguf(tmp_path)
    resolve_target(path, tmp_path / "cache")
    assert len(opened) == 1 and gguf.GGUFReader is counting


def test_a_ggufs_tokenizer_is_read_once_from_the_file_then_from_its_conversion(tmp_path, monkeypatch):
    opened, reader = [], gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda path, *args, **kwargs: opened.append(path) or reader(path, *args,
                                                                                                         **kwargs))
    _, path = tiny_gguf(tmp_path)
    expected = prompt_ids(load_tokenizer(path), MESSAGES)
    assert len(opened) == 1
    resolve_target(path)  # the conversion beside the file
    opened.clear()
    assert prompt_ids(load_tokenizer(path), MESSAGES) == expected and opened == []


def test_the_conversion_is_reused_until_the_gguf_changes(tmp_path, conversions):
    _, path = tiny_gguf(tmp_path)
    weights = Path(resolve_target(path)) / "model.safetensors"
    assert weights.parent == tmp_path / "tiny.gguf.hf"  # the default: beside the file
    written = weights.stat().st_mtime_ns
    assert resolve_target(path) == str(weights.parent) and resolve_target(tmp_path) == str(weights.parent)
    assert conversions == [path] and weights.stat().st_mtime_ns == written
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # the file was replaced
    resolve_target(path)
    assert conversions == [path, path]


def test_a_run_links_the_conversion_the_tools_made_instead_of_converting_again(tmp_path, conversions):
    _, path = tiny_gguf(tmp_path)
    shared = Path(resolve_target(path))  # what regenerate and eval made beside the file
    run_copy = Path(resolve_target(path, tmp_path / "run" / "target-hf"))
    assert conversions == [path] and run_copy == tmp_path / "run" / "target-hf"
    for name in ("model.safetensors", "config.json", SOURCE_RECORD):
        assert (run_copy / name).read_bytes() == (shared / name).read_bytes()
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # the file was replaced
    resolve_target(path, tmp_path / "run2" / "target-hf")  # both folders are stale now: a real conversion
    assert conversions == [path, path]


def test_a_killed_conversion_is_not_reused(tmp_path, conversions):
    model, path = tiny_gguf(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "config.json").write_text("{")  # what a conversion killed before its record leaves
    FrozenTarget.load(resolve_target(path, cache), LAYER_IDS, torch.float32, torch.device("cpu"))
    assert conversions == [path]


def test_the_default_cache_leaves_an_unwritable_folder_for_the_home_cache(tmp_path, monkeypatch):
    _, path = tiny_gguf(tmp_path / "models")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(os, "access", lambda *_: False)
    cache = default_cache_dir(path)
    assert cache.parent == tmp_path / "home" / ".cache" / "dflash" and cache.name.startswith("tiny-")


def test_a_folder_with_one_gguf_is_a_target_and_one_with_two_is_refused(tmp_path):
    _, path = tiny_gguf(tmp_path)
    assert gguf_file(tmp_path) == path
    (tmp_path / "other.gguf").write_bytes(path.read_bytes())
    with pytest.raises(TargetError, match=r"2 GGUF files \(other.gguf, tiny.gguf\); pass the path"):
        resolve_target(tmp_path)
    assert gguf_file(path) == path  # naming the file settles it
    (tmp_path / "config.json").write_text("{}")
    assert gguf_file(tmp_path) is None  # an HF folder, whatever else it holds


def test_a_corrupt_gguf_is_refused_naming_the_file(tmp_path):
    _, path = tiny_gguf(tmp_path)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(TargetError, match=f"{truncated}: cannot read it as a GGUF causal LM .*truncated or corrupt"):
        resolve_target(truncated, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_without_the_gguf_package_the_error_says_how_to_install_it(tmp_path, monkeypatch):
    _, path = tiny_gguf(tmp_path)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    for read in (resolve_target, load_tokenizer):
        with pytest.raises(TargetError, match="pip install gguf"):
            read(path)


def test_training_converts_on_rank_0_while_the_other_ranks_wait(tmp_path, monkeypatch):
    import dflash.training.run as train

    _, path = tiny_gguf(tmp_path)
    events: list[str] = []
    monkeypatch.setattr(train.dist, "barrier", lambda: events.append("barrier"))
    monkeypatch.setattr(gguf_target, "_convert", lambda source, cache, convert=gguf_target._convert: (
        events.append("convert"), convert(source, cache)))
    cache = run_target_dir(tmp_path / "run")
    for rank, local_rank, fresh_node, expected in ((0, 0, False, ["convert", "barrier", "barrier"]),
                                                   (1, 1, False, ["barrier", "barrier"]),
                                                   (2, 0, True, ["barrier", "convert", "barrier"])):
        if fresh_node:  # a node that does not see rank 0's filesystem converts for itself
            os.rename(cache, tmp_path / "elsewhere")
        events.clear()
        config = SimpleNamespace(model=SimpleNamespace(target=str(path), tokenizer=str(path)),
                                 train=SimpleNamespace(output_dir=str(tmp_path / "run")))
        train.settle_target(config, RankInfo(rank, 3, local_rank, torch.device("cpu")))
        assert events == expected, rank
        assert config.model.target == str(cache) and config.model.tokenizer == str(path)


def test_data_prepare_takes_a_gguf_target_and_converts_it_for_the_run(tmp_path, capsys):
    from dflash.tools.data import main as data_main

    _, path = tiny_gguf(tmp_path)
    out = tmp_path / "run"
    flags = ["--target", str(path), "--train-data", str(write_chat_jsonl(tmp_path / "chats.jsonl", 8, 0)),
             "--output-dir", str(out), "--max-length", "128", "--max-tokens", "512", "--max-anchors", "8"]
    assert data_main(["prepare", *flags]) == 0
    assert (run_target_dir(out) / "model.safetensors").is_file()
    assert (out / "data" / "train" / "manifest.json").is_file()
    assert data_main(["stats", *flags]) == 0
    assert "8 samples read, 8 kept" in capsys.readouterr().out
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(b"")
    assert data_main(["stats", *flags[2:], "--target", str(tmp_path / "two")]) == 2
    assert "2 GGUF files (a.gguf, b.gguf)" in capsys.readouterr().err


def test_regenerate_serves_a_gguf_target(tmp_path):
    from dflash.data.regenerate import RegenerateArgs, regenerate

    _, path = tiny_gguf(tmp_path)
    prompts = write_chat_jsonl(tmp_path / "chats.jsonl", 2, 0)
    output = regenerate(RegenerateArgs(target=str(path), prompts=str(prompts), output=str(tmp_path / "regen.jsonl"),
                                       engine="hf", max_new_tokens=4, device="cpu", dtype="float32"))
    assert len(output.read_text().splitlines()) == 2
    assert (tmp_path / "tiny.gguf.hf" / "gguf_source.json").is_file()


@pytest.mark.parametrize("placeholders", [gguf.TokenType.UNUSED, gguf.TokenType.USER_DEFINED])
def test_the_mask_is_the_first_placeholder_row_of_a_gguf_tokenizer(tmp_path, placeholders):
    """A Qwen GGUF lists every embedding row as a token, the rows without one as "[PAD<row>]":
    the default mask is the first of those, never a real token."""
    from dflash.target.frozen import resolve_mask_token_id

    model, path = tiny_gguf(tmp_path, placeholders=placeholders)
    first = len(make_tiny_tokenizer())
    config = load_target_config(resolve_target(path))
    for tokenizer in (load_tokenizer(path), load_tokenizer(tmp_path / "tiny.gguf.hf")):  # the file's, the copy
        assert len(tokenizer) == config.vocab_size == model.config.vocab_size  # no row past the tokenizer
        assert tokenizer.convert_ids_to_tokens(first) == f"[PAD{first}]"
        assert resolve_mask_token_id(tokenizer, config, None) == first


@pytest.mark.parametrize("converted", [False, True], ids=["from-the-file", "from-its-conversion"])
def test_a_gguf_targets_tokenizer_is_the_one_a_tokenizer_flag_is_checked_against(tmp_path, converted):
    from dflash.data.tokenizer_match import check_tokenizer_matches_target
    from dflash.util.cli import ConfigError
    from tiny_tokenizer import _MERGED_WORDS

    _, path = tiny_gguf(tmp_path)
    if converted:
        resolve_target(path)
    check_tokenizer_matches_target(load_tokenizer(path), str(path), str(path))  # the file's own
    check_tokenizer_matches_target(make_tiny_tokenizer(), str(path), "tokenizer-folder")  # the same vocabulary
    with pytest.raises(ConfigError, match="vocabulary: 65 of the first 325 ids name other tokens than in the "
                                          "tokenizer the target ships"):
        check_tokenizer_matches_target(make_tiny_tokenizer(words=_MERGED_WORDS[::-1]), str(path), "tokenizer-folder")
