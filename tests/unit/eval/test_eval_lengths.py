"""`python -m dflash.eval --max-new-tokens 12 6` judges both lengths in one process: one target
load, one decoder (built for the longest, reused for the shorter), one report file each, and the
figures of judging each length alone."""

from __future__ import annotations

import json

import pytest
import torch

import dflash.eval.evaluate as evaluate_module
from dflash.drafter.export import export_drafter
from dflash.eval.__main__ import main as eval_main
from dflash.target.frozen import FrozenTarget, default_target_layer_ids, load_target_config

FIGURES = ("prompts", "tau", "acceptance", "tokens", "diverged", "teacher_forced_acc", "teacher_forced_streak",
           "teacher_forced_tau")


def test_several_lengths_in_one_call_reuse_one_decoder_and_give_each_lengths_own_figures(tiny_setup, tmp_path,
                                                                                         monkeypatch):
    from conftest import tiny_drafter

    layers = default_target_layer_ids(load_target_config(str(tiny_setup["target"])).num_hidden_layers, 3)
    target = FrozenTarget.load(str(tiny_setup["target"]), layers, torch.float32, torch.device("cpu"))
    export_drafter(tiny_drafter(target, block_size=4, seed=3), tmp_path / "drafter", dtype=torch.float32)
    argv = ["--target", str(tiny_setup["target"]), "--drafter", str(tmp_path / "drafter"), "--prompts",
            str(tiny_setup["heldout"]), "--num-prompts", "3", "--device", "cpu", "--dtype", "float32"]
    built = []
    real_decoder = evaluate_module.Decoder
    monkeypatch.setattr(evaluate_module, "Decoder", lambda *a, **k: built.append(a[2]) or real_decoder(*a, **k))
    assert eval_main([*argv, "--max-new-tokens", "6", "12", "--output", str(tmp_path / "both" / "eval.json")]) == 0
    assert len(built) == 1, f"one decoder serves both lengths, not {len(built)} (capacities {built})"
    for length in (6, 12):
        assert eval_main([*argv, "--max-new-tokens", str(length), "--output", str(tmp_path / f"alone_{length}.json")]) == 0
        alone = json.loads((tmp_path / f"alone_{length}.json").read_text())["drafter"]
        together = json.loads((tmp_path / "both" / f"eval_{length}.json").read_text())["drafter"]
        assert {k: together[k] for k in FIGURES} == {k: alone[k] for k in FIGURES}, length
    assert sorted(p.name for p in (tmp_path / "both").iterdir()) == ["eval_12.json", "eval_6.json"]
    six = json.loads((tmp_path / "both" / "eval_6.json").read_text())["drafter"]
    twelve = json.loads((tmp_path / "both" / "eval_12.json").read_text())["drafter"]
    assert six["tokens"] < twelve["tokens"] <= 12 * 3  # each report decoded to its own length


@pytest.mark.gpu
def test_on_a_gpu_a_kept_decoder_judges_a_shorter_length_as_its_own_decoder_would():
    """Its steps compiled and replayed as CUDA graphs, the decoder made for 24 new tokens decodes
    the 12-token judging as a decoder made for 12 does (float32: the same tokens, acceptance)."""
    from conftest import tiny_drafter, tiny_target

    from dflash.eval.evaluate import evaluate

    target = tiny_target("qwen3", dtype=torch.float32)
    target.model.cuda()
    drafter = tiny_drafter(target, block_size=4, seed=3)
    prompts = [[5, 9, 13, 7, 21, 3], [11, 4, 8, 30, 2, 6, 17, 40, 41]]
    alone = evaluate(target, drafter, prompts, 12, set())
    decoders: dict = {}
    longer = evaluate(target, drafter, prompts, 24, set(), decoders=decoders)
    shorter = evaluate(target, drafter, prompts, 12, set(), decoders=decoders)
    (decoder,) = decoders.values()
    assert decoder.session.graphs.enabled and decoder.capacity >= max(map(len, prompts)) + 24
    assert longer.tokens == 48 and alone.lossless and shorter.lossless
    for name in ("tokens", "tau", "acceptance", "teacher_forced_acc", "teacher_forced_tau"):
        assert getattr(shorter, name) == getattr(alone, name), name
