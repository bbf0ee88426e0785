"""The ablation sweep end to end on a tiny setup: a variant trains through train_drafter.py, a run
that already has its eval.json is reused (the default, shared by every group), --baseline sets the
flags every run starts from, the table holds each variant's real tau, and --table-only tabulates
what has finished without training."""

from __future__ import annotations

import json

from conftest import tiny_args


def test_a_small_sweep_trains_what_is_missing_and_tabulates_tau(tiny_setup, tmp_path, monkeypatch):
    from dflash.tools import ablations

    monkeypatch.setattr(ablations, "GROUPS", {
        "anchors": [("random", []), ("stride", ["--anchors", "stride"])],
        "slot weights": [("decay", [])],  # its default is the anchors group's: trained once
    })
    base = tiny_args(tiny_setup, tmp_path / "unused")[:4]  # --target T --train-data D
    extra = [*base, "--eval-data", str(tiny_setup["train"]), "--eval-prompts", "1", "--eval-max-new-tokens", "4",
             "--max-steps", "1", "--num-draft-layers", "1", "--block-size", "4", "--max-anchors", "8",
             "--max-length", "96", "--max-tokens", "256", "--num-target-features", "2"]
    finished = tmp_path / "sweep" / "default-seed0"  # as an interrupted sweep left it
    finished.mkdir(parents=True)
    (finished / "eval.json").write_text(json.dumps({"trained": {"tau": 9.5}}))
    results = ablations.main(["--out", str(tmp_path / "sweep"), "--seeds", "0", "--extra", " ".join(extra),
                              "--baseline", "--loss dpace"])
    runs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert runs == ["anchors-stride-seed0", "default-seed0"]
    assert (tmp_path / "sweep" / "anchors-stride-seed0" / "drafter" / "model.safetensors").is_file()
    assert [v for v, _ in results["anchors"]] == ["random", "stride"]
    assert results["anchors"][0][1] == results["slot weights"][0][1] == [9.5], "reused, and shared by both groups"
    assert 1.0 <= results["anchors"][1][1][0] < 9.5  # trained for real: a 1-step drafter accepts little
    command = (tmp_path / "sweep" / "anchors-stride-seed0.log").read_text().splitlines()[0]
    assert "--loss dpace --anchors stride" in command, "the baseline's flags, then the variant's"
    table = (tmp_path / "sweep" / "ablations.md").read_text()
    assert "| anchors | stride |" in table and "| slot weights | decay | 9.50 |" in table
    partial = ablations.main(["--out", str(tmp_path / "sweep"), "--seeds", "0,1", "--table-only"])
    assert partial == results, "seed 1 has not run: left out, not trained"
    assert not any(p.name.endswith("seed1") for p in (tmp_path / "sweep").iterdir())
    (tmp_path / "sweep" / "anchors-stride-seed0" / "eval.json").unlink()
    assert "| anchors | stride | not run | | 0 |" in ablations.table(
        ablations.main(["--out", str(tmp_path / "sweep"), "--seeds", "0", "--table-only"]))


def test_a_teacher_forced_sweep_scores_each_run_by_the_tau_at_its_last_step_without_the_closing_decode(
        tiny_setup, tmp_path, monkeypatch):
    from dflash.tools import ablations

    monkeypatch.setattr(ablations, "GROUPS", {"block size": [("default", [])]})
    base = tiny_args(tiny_setup, tmp_path / "unused")[:4]
    extra = [*base, "--eval-data", str(tiny_setup["train"]), "--eval-prompts", "1", "--eval-max-new-tokens", "4",
             "--eval-every", "100", "--max-steps", "2", "--num-draft-layers", "1", "--block-size", "8",
             "--max-anchors", "8", "--max-length", "96", "--max-tokens", "256", "--num-target-features", "2"]
    results = ablations.main(["--out", str(tmp_path / "sweep"), "--seeds", "0", "--extra", " ".join(extra),
                              "--score", "teacher-forced"])
    run = tmp_path / "sweep" / "default-seed0"
    assert (run / "drafter" / "config.json").is_file() and not (run / "eval.json").exists(), "no closing decode"
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == last["tau_step"] == 2 and results["block size"] == [("default", [last["tau"]])]
    assert "--final-eval false" in (tmp_path / "sweep" / "default-seed0.log").read_text().splitlines()[0]
