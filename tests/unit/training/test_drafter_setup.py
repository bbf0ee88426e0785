"""What a drafter rank builds: the DeepSpeed config our flags fill in, and the precision the
engine trains in (bf16 weights with fp32 master weights and fp32 Adam moments)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO, free_port, run_two_at_a_time
from dflash.training.drafter_setup import default_deepspeed_config, deepspeed_config, train_dtype

ENGINE_PRECISION = """
import json, os, sys, torch, deepspeed
from types import SimpleNamespace
from dflash.training.drafter_setup import deepspeed_config
torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
train = SimpleNamespace(deepspeed_config="ds_configs/zero1.json", grad_accum=1, grad_clip=1.0, precision="bf16")
config = deepspeed_config(SimpleNamespace(train=train), torch.device("cpu"))
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
loss = engine(torch.randn(4, 8).to(torch.bfloat16)).float().pow(2).mean()
engine.backward(loss)
engine.step()
print(json.dumps({
    "weights": sorted({str(p.dtype) for p in engine.module.parameters()}),
    "master": sorted({str(p.dtype) for g in optimizer.param_groups for p in g["params"]}),
    "moments": sorted({str(v.dtype) for s in optimizer.state.values() for k, v in s.items() if k.startswith("exp_avg")}),
}), flush=True)
torch.distributed.destroy_process_group()  # left to interpreter exit, gloo's threads once aborted the process
"""


def test_auto_fields_are_filled_from_the_flags():
    train = SimpleNamespace(deepspeed_config=None, grad_accum=3, grad_clip=0.5, precision="auto")
    config = deepspeed_config(SimpleNamespace(train=train), torch.device("cpu"))
    assert config["gradient_accumulation_steps"] == 3 and config["gradient_clipping"] == 0.5
    assert config["bf16"]["enabled"] is False  # CPU trains in fp32 by default
    assert config["checkpoint"]["tag_validation"] == "Ignore"
    assert train_dtype(SimpleNamespace(train=train), torch.device("cuda")) == torch.bfloat16


@pytest.mark.parametrize("device, copy", [("cuda", "zero1.json"), ("cpu", "cpu.json")])
def test_the_default_deepspeed_settings_are_built_in_and_ds_configs_writes_them_out(device, copy):
    """An installed package has no ds_configs/: the default is built in code, and the files users
    start from say the same."""
    assert default_deepspeed_config(torch.device(device)) == json.loads((REPO / "ds_configs" / copy).read_text())


def test_precision_bf16_on_cpu_enables_bf16_and_a_contradicting_config_is_refused(tmp_path):
    from dflash.util.cli import ConfigError

    train = SimpleNamespace(deepspeed_config=None, grad_accum=1, grad_clip=1.0, precision="bf16")
    assert deepspeed_config(SimpleNamespace(train=train), torch.device("cpu"))["bf16"]["enabled"] is True
    fixed = tmp_path / "fp32.json"
    fixed.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": False}}))
    train.deepspeed_config = str(fixed)
    with pytest.raises(ConfigError, match=f"--deepspeed-config {fixed}: bf16.enabled is False but the run trains "
                                          r"in bf16 \(--precision bf16\)"):
        deepspeed_config(SimpleNamespace(train=train), torch.device("cpu"))


@pytest.fixture(scope="module")
def engine_scripts() -> dict[str, subprocess.CompletedProcess]:
    """ENGINE_PRECISION ("bf16") and MUON_ENGINE below ("muon"), each in a process of its own, the two at once."""
    def run(script: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", script, str(free_port())], cwd=REPO, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu", "LOCAL_RANK": "0",
                                                           **env})

    return run_two_at_a_time({
        "bf16": functools.partial(run, ENGINE_PRECISION),
        # Muon's compiled kernel: a minute to build on CPU
        "muon": functools.partial(run, MUON_ENGINE, TORCH_COMPILE_DISABLE="1"),
    })


def test_bf16_training_keeps_fp32_master_weights_and_moments(engine_scripts):
    proc = engine_scripts["bf16"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    dtypes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert dtypes == {"weights": ["torch.bfloat16"], "master": ["torch.float32"], "moments": ["torch.float32"]}


MUON_ENGINE = """
import json, sys, torch, deepspeed
from types import SimpleNamespace
from dflash.training.drafter_setup import deepspeed_config, make_optimizer
torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
train = SimpleNamespace(deepspeed_config="ds_configs/cpu.json", grad_accum=1, grad_clip=1.0, precision="fp32",
                        optimizer="muon", lr=1e-3, muon_lr=0.02, weight_decay=0.0)
config = SimpleNamespace(train=train)
ds = deepspeed_config(config, torch.device("cpu"))
model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.LayerNorm(8))
before = [p.detach().clone() for p in model.parameters()]
optimizer = make_optimizer(config, model, ds, torch.device("cpu"))
engine, optimizer, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
engine.step()
groups = [(g.get("use_muon"), g["lr"], sum(p.numel() for p in g["params"])) for g in optimizer.optimizer.param_groups]
print(json.dumps({"passed_none": optimizer is not None, "groups": groups,
                  "adam_half": type(optimizer.optimizer.aux_optimizer).__name__,
                  "moved": [bool((p.detach() != b).any()) for p, b in zip(engine.module.parameters(), before)]}),
      flush=True)
torch.distributed.destroy_process_group()  # left to interpreter exit, gloo's threads once aborted the process
"""


def test_muon_takes_the_matrices_and_adamw_the_rest(engine_scripts):
    proc = engine_scripts["muon"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    by_kind = {use_muon: (lr, numel) for use_muon, lr, numel in report["groups"]}  # ZeRO holds flat partitions
    assert by_kind[True] == (0.02, 64)  # the 8 x 8 weight matrix, at --muon-lr
    assert by_kind[False] == (1e-3, 16)  # the norm's weight and bias, at --lr
    assert report["moved"] == [True, True, True]
    assert report["adam_half"] == "AdamW"  # torch's, so no DeepSpeed op is compiled at start


def test_the_recipe_check_compares_only_what_the_checkpoint_records(tmp_path):
    from dflash.util.cli import ConfigError
    from dflash.config import TrainArgs, check_resumed_recipe, recipe_settings

    saved = recipe_settings(TrainArgs())
    check_resumed_recipe(saved, TrainArgs(), tmp_path)  # the same flags: no error
    check_resumed_recipe({}, TrainArgs(optimizer="muon"), tmp_path)  # an older checkpoint records none
    with pytest.raises(ConfigError, match=r"--gamma 5.0 \(the checkpoint: None\); --optimizer 'muon' "
                                          r"\(the checkpoint: 'adamw'\)"):
        check_resumed_recipe(saved, TrainArgs(optimizer="muon", gamma=5.0), tmp_path)


@pytest.mark.parametrize("weight_decay", [0.0, 0.5])
def test_weight_decay_shrinks_the_weight_matrices_and_leaves_the_norm_gains(weight_decay):
    from dflash.nn.transformer import RMSNorm
    from dflash.training.drafter_setup import make_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), RMSNorm(8, eps=1e-6))
    model[1].weight.data.uniform_(0.5, 1.5)
    before = [p.detach().clone() for p in model.parameters()]
    train = SimpleNamespace(optimizer="adamw", lr=0.1, weight_decay=weight_decay)
    optimizer = make_optimizer(SimpleNamespace(train=train), model, {}, torch.device("cpu"))
    assert len(optimizer.param_groups) == (2 if weight_decay else 1)  # one group: as checkpoints without decay hold
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # a zero gradient: Adam's own step is 0, so what moves is the decay alone
    optimizer.step()
    matrix, gain = (p.detach() for p in model.parameters())
    torch.testing.assert_close(matrix, before[0] * (1 - 0.1 * weight_decay), rtol=0, atol=1e-7)
    torch.testing.assert_close(gain, before[1], rtol=0, atol=0)
