"""What a drafter rank builds: the DeepSpeed config our flags fill in, and the precision the
engine trains in (bf16 weights with fp32 master weights and fp32 Adam moments)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import torch

from conftest import REPO, free_port
from dflash.drafter_setup import deepspeed_config, train_dtype

ENGINE_PRECISION = """
import json, os, sys, torch, deepspeed
from types import SimpleNamespace
from dflash.drafter_setup import deepspeed_config
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
}))
"""


def test_auto_fields_are_filled_from_the_flags():
    train = SimpleNamespace(deepspeed_config=None, grad_accum=3, grad_clip=0.5, precision="auto")
    config = deepspeed_config(SimpleNamespace(train=train), torch.device("cpu"))
    assert config["gradient_accumulation_steps"] == 3 and config["gradient_clipping"] == 0.5
    assert config["bf16"]["enabled"] is False  # CPU trains in fp32 by default
    assert config["checkpoint"]["tag_validation"] == "Ignore"
    assert train_dtype(SimpleNamespace(train=train), torch.device("cuda")) == torch.bfloat16


def test_bf16_training_keeps_fp32_master_weights_and_moments():
    proc = subprocess.run([sys.executable, "-c", ENGINE_PRECISION, str(free_port())], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu", "LOCAL_RANK": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    dtypes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert dtypes == {"weights": ["torch.bfloat16"], "master": ["torch.float32"], "moments": ["torch.float32"]}
