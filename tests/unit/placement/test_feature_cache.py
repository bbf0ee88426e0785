"""--cache-target-features: a sample's features come from the target once, then from memory."""

from __future__ import annotations

import torch

from conftest import tiny_causal_lm, write_chat_jsonl
from dflash.data.dataset import TokenDataset
from dflash.data.prepare import prepare_dataset
from dflash.placement.features import FeatureCache, compute_features
from dflash.target.frozen import FrozenTarget
from tiny_tokenizer import make_tiny_tokenizer


class CountingTarget(FrozenTarget):
    calls = 0

    def features(self, input_ids, with_final_hidden=False):
        self.calls += 1
        return super().features(input_ids, with_final_hidden)


def test_cached_features_equal_the_targets_and_skip_its_forward(tmp_path):
    tokenizer = make_tiny_tokenizer()
    dataset = TokenDataset(prepare_dataset(write_chat_jsonl(tmp_path / "chats.jsonl", 8, 0), tokenizer,
                                           tmp_path / "shard", max_length=64))
    model = tiny_causal_lm("qwen3", vocab_size=len(tokenizer) + 3).double()
    target = CountingTarget(model, [1, 3, 5])
    lengths = dataset.lengths
    assert len(set(lengths.tolist())) > 1, "the samples need different lengths for padding to show"
    cache = FeatureCache()
    first = compute_features(target, dataset, [0, 1, 2], 0, with_final_hidden=True, cache=cache)
    second = compute_features(target, dataset, [3, 4], 0, with_final_hidden=True, cache=cache)
    assert target.calls == 2
    # Other batch company: the rows come from memory, padded to the new width with zeros.
    mixed = compute_features(target, dataset, [4, 0, 2], 0, with_final_hidden=True, cache=cache)
    assert target.calls == 2
    plain = compute_features(target, dataset, [4, 0, 2], 0, with_final_hidden=True)
    assert target.calls == 3
    for row, index in enumerate([4, 0, 2]):
        n = int(lengths[index])
        torch.testing.assert_close(mixed.features[row, :n], plain.features[row, :n], rtol=0, atol=1e-12)
        torch.testing.assert_close(mixed.final_hidden[row, :n], plain.final_hidden[row, :n], rtol=0, atol=1e-12)
        assert not mixed.features[row, n:].any() and not mixed.final_hidden[row, n:].any()
    assert torch.equal(mixed.input_ids, plain.input_ids) and torch.equal(mixed.loss_mask, plain.loss_mask)
    # A batch with one sample never seen runs the target again.
    compute_features(target, dataset, [5, 0], 0, with_final_hidden=True, cache=cache)
    assert target.calls == 4
    assert first.features.shape[0] == 3 and second.features.shape[0] == 2


def test_a_cache_too_large_for_free_memory_is_skipped_with_a_warning(monkeypatch, caplog):
    import numpy as np
    from types import SimpleNamespace

    from dflash.training import run

    config = SimpleNamespace(data=SimpleNamespace(cache_target_features=True))
    dataset = type("Dataset", (), {"lengths": np.full(1000, 512), "__len__": lambda self: 1000})()
    spec = SimpleNamespace(feature_dim=1024, hidden_dim=256, with_final_hidden=False, feature_dtype=torch.float32,
                           device=torch.device("cpu"))
    ranks = SimpleNamespace(rank=0)
    pages = {"SC_PAGE_SIZE": 4096, "SC_AVPHYS_PAGES": 2 ** 30 // 4096}  # 1 GiB free; the features need 2 GiB
    monkeypatch.setattr(run.os, "sysconf", lambda name: pages[name])
    assert run.feature_cache(config, dataset, spec, ranks) is None
    assert "not caching target features" in caplog.text and "2.0 GiB" in caplog.text
    pages["SC_AVPHYS_PAGES"] = 8 * 2 ** 30 // 4096  # 8 GiB free
    assert isinstance(run.feature_cache(config, dataset, spec, ranks), FeatureCache)
    config.data.cache_target_features = False
    assert run.feature_cache(config, dataset, spec, ranks) is None
