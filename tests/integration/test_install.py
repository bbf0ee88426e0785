"""`pip install .` (not editable) gives the commands: from the installed copy alone, with no
clone on the path, `dflash-train --help` lists the flags, every console script's function is
there, and the demo run, whose target and data stay in the clone, says what to do instead."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO

COMMANDS = {"dflash-train", "dflash-regenerate", "dflash-eval", "dflash-data", "dflash-report"}


def console_scripts(site: Path) -> dict[str, bool]:
    """Each console script installed in `site`: whether its module there defines its function (read
    with ast: importing every command would take longer than the rest of the test)."""
    (dist,) = [d for d in importlib.metadata.distributions(path=[str(site)]) if d.metadata["Name"] == "dflash-train"]
    found = {}
    for script in dist.entry_points.select(group="console_scripts"):
        module = site / script.module.replace(".", "/")
        path = module.with_suffix(".py") if module.with_suffix(".py").is_file() else module / "__init__.py"
        found[script.name] = path.is_file() and script.attr in {
            node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.FunctionDef)}
    return found


def test_a_non_editable_install_gives_the_commands_and_the_demo_says_where_its_assets_are(tmp_path):
    source, site = tmp_path / "source", tmp_path / "site"
    # what the build reads, copied: a build in the clone would leave build/ and egg-info there
    shutil.copytree(REPO / "dflash", source / "dflash", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "requirements.txt", "README.md"):
        shutil.copy(REPO / name, source / name)
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(source)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    assert console_scripts(site) == dict.fromkeys(COMMANDS, True)
    assert {p.name for p in (site / "bin").iterdir()} >= COMMANDS
    assert not list(site.rglob("*.safetensors")), "the package holds code only"

    def dflash_train(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(site / "bin" / "dflash-train"), *flags], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(site)})

    helped = dflash_train("--help")
    assert helped.returncode == 0 and "--train-data" in helped.stdout and "--deepspeed-config" in helped.stdout, \
        helped.stderr
    demo = dflash_train("--output-dir", str(tmp_path / "run"))
    assert demo.returncode == 2 and "Traceback" not in demo.stderr, demo.stderr
    assert str(site / "assets" / "demo") in demo.stderr, "the installed copy ran, not the clone"
    assert demo.stderr.strip().endswith("run from a clone, or pass --target and --train-data"), demo.stderr
