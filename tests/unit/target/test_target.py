"""A split-placement drafter rank reads only the embedding and lm_head from the target's
safetensors, also from a sharded checkpoint such as the shipped demo target's."""

from __future__ import annotations

import torch

from dflash.demo import DEMO_TARGET_DIR
from dflash.target.frozen import FrozenTarget


def test_embedding_and_head_from_the_sharded_demo_target_equal_the_full_load():
    assert len(list(DEMO_TARGET_DIR.glob("model-*-of-*.safetensors"))) > 1, "the demo target ships in shards"
    full = FrozenTarget.load(str(DEMO_TARGET_DIR), [1], torch.float32, torch.device("cpu"))
    embed, head = FrozenTarget.load_embedding_and_head(str(DEMO_TARGET_DIR), torch.float32, torch.device("cpu"))
    assert torch.equal(embed.weight, full.embed_tokens.weight)
    assert torch.equal(head.weight, full.lm_head.weight)
