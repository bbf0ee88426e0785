"""Every command's --help lists each flag once, in its dash spelling, with its default once; the
underscore spelling still parses."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

from dflash.training import __main__ as train_drafter

COMMANDS = ["eval.__main__", "regenerate", "data.sharegpt", "tools.ablations", "benchmarks.step", "benchmarks.data",
            "benchmarks.decode", "benchmarks.e2e", "benchmarks.assets", "benchmarks.checkpoint",
            "benchmarks.target_confidence"]


def help_text(capsys, monkeypatch, main) -> str:
    monkeypatch.setattr(sys, "argv", ["prog", "--help"])  # for the mains that read sys.argv themselves
    with pytest.raises(SystemExit) as exit_:
        main(["--help"]) if main.__code__.co_argcount else main()
    assert exit_.value.code == 0
    return capsys.readouterr().out


def options(text: str) -> list[tuple[str, str]]:
    """The help's option list: (first spelling, the whole entry with its lines joined)."""
    entries = re.split(r"\n(?=  -)", text.split("options:\n", 1)[1])
    return [(entry.split()[0].rstrip(","), " ".join(entry.split())) for entry in entries]


@pytest.mark.parametrize("command", ["train_drafter", *COMMANDS])
def test_help_lists_each_flag_once_with_its_default_once(capsys, monkeypatch, command):
    main = train_drafter.main if command == "train_drafter" else importlib.import_module(f"dflash.{command}").main
    text = help_text(capsys, monkeypatch, main)
    assert not re.findall(r"--\w*_[\w-]*", text), text
    entries = options(text)
    flags = [flag for flag, _ in entries]
    assert len(flags) == len(set(flags)) > 1, flags
    for _, entry in entries:
        assert "default: None" not in entry, entry
        assert entry.lower().count("default") <= 1, entry


def test_help_of_train_drafter_shows_the_default_of_a_flag_without_help(capsys, monkeypatch):
    entries = dict(options(help_text(capsys, monkeypatch, train_drafter.main)))
    assert entries["--grad-clip"] == "--grad-clip GRAD_CLIP default: 1.0"
    assert entries["--lr"].endswith("(default: 0.0006)")
    assert entries["--target"].endswith("(default: the shipped demo target)")


@pytest.mark.parametrize("command", ["train_drafter", "eval.__main__", "regenerate"])
def test_training_evaluation_and_regeneration_take_one_thinking_switch(capsys, monkeypatch, command):
    """--thinking auto|on|off everywhere prompts are rendered, auto (the template's own) the default."""
    main = train_drafter.main if command == "train_drafter" else importlib.import_module(f"dflash.{command}").main
    entry = dict(options(help_text(capsys, monkeypatch, main)))["--thinking"]
    assert entry.startswith("--thinking THINKING auto (the default: the chat template's own choice"), entry
    assert "| on | off" in entry


def test_every_command_builds_its_parser_with_cli_parser():
    dflash = Path(__file__).resolve().parents[3] / "dflash"
    direct = [path.name for path in dflash.rglob("*.py")
              if "HfArgumentParser(" in path.read_text() and path.name != "cli.py"]
    assert not direct, f"{direct}: build the parser with dflash.util.cli.cli_parser"


def test_the_underscore_spelling_still_parses(tmp_path):
    from dflash.config import parse_config

    config = parse_config(["--max_steps", "3", "--num-draft-layers", "1", "--output-dir", str(tmp_path)],
                          for_training=False)
    assert config.train.max_steps == 3 and config.model.num_draft_layers == 1
