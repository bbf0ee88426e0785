"""Tiny random-weight targets and drafters built from configs (nothing is downloaded)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash.drafter.model import DFlashDrafter, drafter_config
from dflash.placement.distributed import LAUNCH_VARS
from dflash.target.frozen import FrozenTarget, default_target_layer_ids

REPO = Path(__file__).resolve().parent.parent
VOCAB = 97
MASK_ID = VOCAB - 1  # an id the random target rarely emits; the real rule is tested elsewhere
K, T = TypeVar("K"), TypeVar("T")


def tiny_causal_lm(arch: str = "qwen3", vocab_size: int = VOCAB, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    )
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(arch)
    return model.eval()


def tiny_target(arch: str = "qwen3", dtype: torch.dtype = torch.float64, seed: int = 0) -> FrozenTarget:
    model = tiny_causal_lm(arch, seed=seed).to(dtype)
    return FrozenTarget(model, default_target_layer_ids(model.config.num_hidden_layers, 3))


def flash_varlen_stand_in(q, k, v, starts_q, starts_k, max_q, max_k, scale, used_k):
    """What flash_varlen computes, sequence by sequence with SDPA (FlashAttention has no CPU
    kernel): queries starts_q[i].. over the used_k[i] keys from starts_k[i], not causal, query
    head h on key/value head h // (Hq / Hkv)."""
    out = torch.empty_like(q)
    for i in range(len(starts_q) - 1):
        first, end, keys = int(starts_q[i]), int(starts_q[i + 1]), slice(int(starts_k[i]), int(starts_k[i] + used_k[i]))
        assert end - first <= max_q and int(used_k[i]) <= max_k
        heads_first = (q[first:end].transpose(0, 1), k[keys].transpose(0, 1), v[keys].transpose(0, 1))
        out[first:end] = torch.nn.functional.scaled_dot_product_attention(*heads_first, scale=scale,
                                                                          enable_gqa=True).transpose(0, 1)
    return out


def tiny_drafter(target: FrozenTarget, block_size: int = 4, num_layers: int = 2, seed: int = 1,
                 window: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    config = drafter_config(target.model.config, num_layers, target.layer_ids, block_size, MASK_ID, window=window)
    return DFlashDrafter(config).to(target.embed_tokens.weight.dtype)


@pytest.fixture(params=["qwen3", "llama"])
def arch(request) -> str:
    return request.param


WORDS = "the cat sat on a mat and then it ran to the dog who was not happy at all".split()


def write_chat_jsonl(path: Path, samples: int, seed: int) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(samples):
            f.write(json.dumps({"prompt": " ".join(rng.choices(WORDS, k=6)),
                                "response": " ".join(rng.choices(WORDS, k=rng.randint(12, 40)))}) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_setup(tmp_path_factory) -> dict[str, Path]:
    """A tiny random Qwen3 target saved as an HF folder with a chat tokenizer, and chat data."""
    from tiny_tokenizer import make_tiny_tokenizer

    root = tmp_path_factory.mktemp("tiny")
    tokenizer = make_tiny_tokenizer()
    model = tiny_causal_lm("qwen3", vocab_size=len(tokenizer) + 3)  # spare rows: one is the mask
    model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    return {"root": root, "target": root / "target",
            "train": write_chat_jsonl(root / "train.jsonl", 48, 0),
            "heldout": write_chat_jsonl(root / "heldout.jsonl", 4, 1)}


def trainer_command(args: list[str], nproc: int = 0) -> list[str]:
    """train_drafter.py as a user runs it: plain python, or torchrun with `nproc` processes."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_port", str(free_port())] if nproc else [sys.executable]
    return [*launcher, str(REPO / "train_drafter.py"), *args]


def user_environment() -> dict[str, str]:
    """This process's environment without the launch variables that a test running the entry
    point in-process leaves behind: with them, every plain-python run would take the port they
    name, and two at once would collide."""
    return {name: value for name, value in os.environ.items() if name not in LAUNCH_VARS}


def run_trainer(args: list[str], nproc: int = 0, timeout: int = 600, env: dict | None = None,
                ) -> subprocess.CompletedProcess:
    """train_drafter.py as a user runs it: plain python, or torchrun with `nproc` processes."""
    return subprocess.run(trainer_command(args, nproc), cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=user_environment() if env is None else env)


def run_two_at_a_time(calls: dict[K, Callable[[], T]]) -> dict[K, T]:
    """Each call's result, two calls running at once: a one-process run (or worker script) is mostly
    its start-up on one core, or a wait, so on a 2-core machine two take about as long as one."""
    with ThreadPoolExecutor(2) as pool:
        futures = {key: pool.submit(call) for key, call in calls.items()}
        return {key: future.result() for key, future in futures.items()}


class BackgroundTrainer:
    """run_trainer started now and collected later (`result()`), so that a test can do something
    else (another run) meanwhile; stderr goes to a file, not a pipe that could fill and stall it."""

    def __init__(self, args: list[str], log: Path, nproc: int = 0):
        self.command, self.log = trainer_command(args, nproc), log
        with self.log.open("w") as err:
            self.proc = subprocess.Popen(self.command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, text=True,
                                         env=user_environment())

    def result(self, timeout: int = 600) -> subprocess.CompletedProcess:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self.proc.kill()
            self.proc.wait()
        return subprocess.CompletedProcess(self.command, self.proc.returncode, "", self.log.read_text())


def start_ranks(args: list[str], world: int, stderr=subprocess.DEVNULL) -> list[subprocess.Popen]:
    """Each rank of train_drafter.py as its own process (no launcher), so a test can kill or
    stop one of them and see what the others do on their own. `stderr` is rank 0's, or a list
    with each rank's."""
    base = {**os.environ, "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port())}
    # Ctrl-C as from a terminal: a suite started in the background (`cmd &`) ignores SIGINT, and
    # its children would inherit that (train_drafter.py then leaves SIGINT alone, as it should)
    errs = stderr if isinstance(stderr, list) else [stderr] + [subprocess.DEVNULL] * (world - 1)
    return [subprocess.Popen([sys.executable, str(REPO / "train_drafter.py"), *args], cwd=REPO,
                             env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                             stdout=subprocess.DEVNULL, stderr=errs[r], text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
            for r in range(world)]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


TINY_RUN_STEPS = 8  # optimizer steps of a tiny_args run


def tiny_args(setup: dict, out: Path, *extra: str) -> list[str]:
    """train_drafter.py flags for a few seconds' run on the tiny_setup target and data."""
    return ["--target", str(setup["target"]), "--train-data", str(setup["train"]), "--output-dir", str(out),
            "--max-steps", str(TINY_RUN_STEPS), "--log-every", "1", "--num-draft-layers", "1", "--block-size", "4",
            "--max-anchors", "8", "--max-length", "96", "--max-tokens", "256", "--num-target-features", "2",
            "--report-to", "none", "--eval-prompts", "0", "--transport-timeout-s", "60", "--seed", "3", *extra]
