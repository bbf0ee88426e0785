"""One thinking mode from regeneration to evaluation, on a tiny target whose chat template has an
enable_thinking switch: regeneration records the mode it rendered prompts in, a training run
records its resolved mode in run_config.json and the exported drafter, and a run or an eval in
another mode than its data's or drafter's stops naming both and the flag."""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path

import pytest

from conftest import run_trainer, run_two_at_a_time, tiny_args, tiny_causal_lm, write_chat_jsonl
from dflash.data.regenerate import main as regenerate_main
from dflash.eval.__main__ import main as eval_main
from tiny_tokenizer import make_thinking_tokenizer


@pytest.fixture(scope="module")
def thinking_setup(tmp_path_factory) -> dict:
    """The tiny target with THINKING_TEMPLATE (default: thinking on), and chat data whose replies
    record that they were generated with thinking on."""
    root = tmp_path_factory.mktemp("thinking")
    tokenizer = make_thinking_tokenizer()
    tiny_causal_lm("qwen3", vocab_size=len(tokenizer) + 3).save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    plain = write_chat_jsonl(root / "plain.jsonl", 48, 0)
    records = [{**json.loads(line), "target_reply": {"thinking": "on"}} for line in plain.read_text().splitlines()]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return {"root": root, "target": root / "target", "train": root / "train.jsonl", "heldout": plain}


def regenerated(setup: dict, out, *extra: str) -> list[dict]:
    argv = ["--target", str(setup["target"]), "--prompts", str(setup["heldout"]), "--output", str(out),
            "--limit", "2", "--max-new-tokens", "4", "--engine", "hf", "--dtype", "float32", "--device", "cpu", *extra]
    assert regenerate_main(argv) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_regenerated_records_say_the_mode_their_prompts_were_rendered_in(thinking_setup, tiny_setup, tmp_path):
    assert {r["target_reply"]["thinking"] for r in regenerated(thinking_setup, tmp_path / "a.jsonl")} == {"on"}
    off = regenerated(thinking_setup, tmp_path / "b.jsonl", "--thinking", "off")
    assert {r["target_reply"]["thinking"] for r in off} == {"off"}
    assert {r["target_reply"]["thinking"] for r in regenerated(tiny_setup, tmp_path / "c.jsonl")} == {"none"}


@pytest.fixture(scope="module")
def thinking_runs(thinking_setup) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """--thinking -> (a training run on the thinking data, its output dir): the default ("auto")
    takes the data's mode, "off" contradicts it. The two runs go at once."""
    flags = {"auto": [], "off": ["--thinking", "off"]}
    outs = {mode: thinking_setup["root"] / f"run-{mode}" for mode in flags}
    procs = run_two_at_a_time({mode: functools.partial(run_trainer, tiny_args(thinking_setup, outs[mode], *extra))
                               for mode, extra in flags.items()})
    return {mode: (procs[mode], out) for mode, out in outs.items()}


def test_a_run_records_its_mode_and_an_eval_in_another_mode_is_refused(thinking_setup, thinking_runs, capsys):
    proc, out = thinking_runs["auto"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "run_config.json").read_text())["thinking"] == "on"
    assert json.loads((out / "data" / "train" / "manifest.json").read_text())["thinking"] == "on"
    for drafter in ("drafter", "drafter-init"):
        assert json.loads((out / drafter / "config.json").read_text())["dflash_config"]["thinking"] == "on"
    argv = ["--drafter", str(out / "drafter"), "--target", str(thinking_setup["target"]),
            "--prompts", str(thinking_setup["heldout"]), "--num-prompts", "1", "--device", "cpu"]
    assert eval_main([*argv, "--thinking", "off"]) == 2
    err = capsys.readouterr().err
    assert (f"--drafter {out / 'drafter'} (dflash_config in its config.json) records thinking 'on', but this run "
            "renders prompts with thinking 'off'") in err and "pass --thinking on" in err


def test_a_run_in_another_mode_than_its_data_stops_naming_both_and_the_flag(thinking_setup, thinking_runs):
    proc, _ = thinking_runs["off"]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"{thinking_setup['train']}:1: target_reply records thinking 'on', but this run renders prompts with "
            "thinking 'off'") in proc.stderr and "pass --thinking on" in proc.stderr
    assert "Traceback" not in proc.stderr
