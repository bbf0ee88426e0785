"""Every variant of every ablation group is a flag set train_drafter.py accepts and applies, on
the demo baseline and on the recipe's defaults, and each group's first variant changes nothing."""

from __future__ import annotations

import shlex

import pytest

from dflash.config import parse_config
from dflash.tools.ablations import BASELINE, GROUPS

CE_ONLY = {"slot weights"}  # slot weights are CE's: the recipe's D-PACE loss weighs slots itself


def parsed_value(config, flag: str):
    name = flag[2:].replace("-", "_")
    part = next(p for p in (config.model, config.data, config.train) if hasattr(p, name))
    return getattr(part, name)


@pytest.mark.parametrize("group, baseline", [(group, baseline) for group in GROUPS for baseline in (BASELINE, "")
                                             if baseline or group not in CE_ONLY])
def test_each_variant_parses_as_training_flags(group, baseline, tmp_path):
    assert GROUPS[group][0][1] == [], f"{group}: the first variant is the baseline"
    for _, flags in GROUPS[group]:
        config = parse_config(["--output-dir", str(tmp_path / "run"), *shlex.split(baseline), *flags],
                              for_training=False)
        for flag, value in zip(flags, flags[1:] + ["--"]):
            if flag.startswith("--") and not value.startswith("--"):
                now = parsed_value(config, flag)
                assert now == type(now)(value), f"{group}: {flag} {value} parsed as {now!r}"


def test_a_variant_that_is_the_baseline_itself_is_not_run_twice(tmp_path):
    from dflash.tools.ablations import variants_run

    (tmp_path / "target").mkdir()
    (tmp_path / "train.jsonl").write_text('{"prompt": "hi", "response": "there"}\n')
    real = f"--target {tmp_path / 'target'} --train-data {tmp_path / 'train.jsonl'}"  # not the demo target

    # the demo's and the small preset's B is 8: the "8" variant is the baseline's own run and names its row
    assert variants_run("block size", BASELINE, "") == [("8", []), ("16", ["--block-size", "16"])]
    assert variants_run("block size", "--preset small", real) \
        == [("8", []), ("16", ["--block-size", "16"])]
    assert variants_run("block size", "", real) == [("16", []), ("8", ["--block-size", "8"])]
    # the recipe's loss is D-PACE: the "ce" label of the first variant would be wrong there
    assert variants_run("loss", "", real) == [
        ("dpace", []), ("ce+dpace", ["--loss", "ce+dpace"])]
    assert variants_run("loss", BASELINE, "") == GROUPS["loss"]
    # under the small preset its own values are the baseline, and the recipe's are probed
    assert variants_run("draft vocabulary", "--preset small", real) == [("32768", []), ("every token", ["--draft-vocab", "0"])]
    assert [name for name, _ in variants_run("anchors per sequence", "--preset small", real)] == ["128", "512", "256"]
