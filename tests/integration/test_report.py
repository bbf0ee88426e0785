"""A run's view: exact tau logged during training, the progress line, and the plots report."""

from __future__ import annotations

import json

import numpy as np
from PIL import Image

from conftest import run_trainer, tiny_args
from dflash.tools.report import PLOTS, main as report_main


def test_periodic_tau_is_logged_and_the_report_draws_every_plot(tiny_setup, tmp_path):
    out = tmp_path / "run"
    args = tiny_args(tiny_setup, out, "--eval-data", str(tiny_setup["heldout"]), "--eval-every", "2",
                     "--eval-prompts", "2", "--eval-max-new-tokens", "12", "--save-every", "0")
    args[args.index("--max-steps") + 1] = "6"
    proc = run_trainer(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    taus = sorted({r["tau_step"]: r["tau"] for r in records if "tau" in r}.items())
    assert [step for step, _ in taus] == [2, 4, 6] and all(tau >= 1.0 for _, tau in taus)
    assert "step 4: tau " in proc.stderr and "(exact, teacher-forced on 2 held-out prompts" in proc.stderr
    assert "ETA" in proc.stderr and "draft pos/s/GPU" in proc.stderr
    eval_report = json.loads((out / "eval.json").read_text())["trained"]
    assert eval_report["teacher_forced_tau"] == taus[-1][1]  # the same drafter, the same measure

    assert report_main([str(out)]) == 0
    for name in PLOTS:
        image = np.asarray(Image.open(out / "report" / f"{name}.png").convert("L"))
        assert image.shape[0] > 200 and image.shape[1] > 400, name
        assert image.std() > 5, f"{name}.png is blank"
    summary = (out / "report" / "report.md").read_text()
    assert "| tau (teacher-forced) |" in summary and "![loss](loss.png)" in summary
    assert "Final evaluation: tau" in summary


def test_report_names_a_folder_without_metrics(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        report_main([str(tmp_path)])
