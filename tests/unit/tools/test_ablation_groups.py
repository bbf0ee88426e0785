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
