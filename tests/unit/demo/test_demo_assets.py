"""Where the demo's target and data are missing (an installed package, which holds code only),
the demo's commands say so and what to do instead of naming a path that does not exist."""

from __future__ import annotations

import pytest

import dflash.demo
from dflash.config import parse_config
from dflash.eval.__main__ import main as eval_main
from dflash.util.cli import ConfigError


@pytest.fixture
def no_demo_data(monkeypatch, tmp_path):
    monkeypatch.setattr(dflash.demo, "DEMO_TRAIN_DATA", tmp_path / "assets" / "demo" / "data" / "train.jsonl")


def test_a_demo_run_without_its_assets_says_to_run_from_a_clone_or_pass_the_files(no_demo_data, tmp_path):
    with pytest.raises(ConfigError, match=r"train\.jsonl is missing\): they ship in assets/demo/ of a clone .*"
                                          r"run from a clone, or pass --target and --train-data$"):
        parse_config(["--output-dir", str(tmp_path / "run")])


def test_the_demo_eval_without_its_assets_says_the_same_with_its_own_flags(no_demo_data, capsys):
    assert eval_main([]) == 2
    assert capsys.readouterr().err.strip().endswith("run from a clone, or pass --target, --drafter and --prompts")
