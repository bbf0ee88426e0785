"""The ablation sweep end to end on a tiny setup: every variant trains through train_drafter.py,
the default is trained once for all groups, and the table holds each variant's real tau."""

from __future__ import annotations

from conftest import tiny_args


def test_a_small_sweep_trains_each_variant_once_and_tabulates_tau(tiny_setup, tmp_path, monkeypatch):
    from dflash import ablations

    monkeypatch.setattr(ablations, "GROUPS", {
        "anchors": [("random", []), ("stride", ["--anchors", "stride"])],
        "slot weights": [("decay", []), ("uniform", ["--slot-weights", "uniform"])],
    })
    base = tiny_args(tiny_setup, tmp_path / "unused")[:4]  # --target T --train-data D
    extra = [*base, "--eval-data", str(tiny_setup["train"]), "--eval-prompts", "2", "--eval-max-new-tokens", "8",
             "--max-steps", "2", "--num-draft-layers", "1", "--block-size", "4", "--max-anchors", "8",
             "--max-length", "96", "--max-tokens", "256", "--num-target-features", "2"]
    results = ablations.main(["--out", str(tmp_path / "sweep"), "--seeds", "0", "--parallel", "2",
                              "--extra", " ".join(extra)])
    runs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert runs == ["anchors-stride-seed0", "default-seed0", "slot-weights-uniform-seed0"]
    assert [v for v, _ in results["anchors"]] == ["random", "stride"]
    assert all(len(taus) == 1 and taus[0] >= 1.0 for g in results.values() for _, taus in g)
    assert results["anchors"][0][1] == results["slot weights"][0][1], "the default run is shared"
    table = (tmp_path / "sweep" / "ablations.md").read_text()
    assert "| anchors | stride |" in table and "| slot weights | uniform |" in table
