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

    def features(self, input_ids, with_final_hidden=False, lengths=None):
        self.calls += 1
        return super().features(input_ids, with_final_hidden, lengths)


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
    assert mixed.reused and not first.reused  # its FLOPs are not the target's
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


def echoed_schedule(num_samples: int, echo: int, span: int):
    """(step, indices) of rank 0 through one epoch of an echoed plan, and its plain plan's length."""
    import numpy as np

    from dflash.data.sampler import RankAwareBucketSampler

    lengths = np.arange(10, 10 + num_samples)
    plain = RankAwareBucketSampler(lengths, [0], 2 * int(lengths.max()), 1, 0).steps_per_epoch()
    sampler = RankAwareBucketSampler(lengths, [0], 2 * int(lengths.max()), 1, 0, echo=echo, echo_span=span)
    return list(sampler.rank_batches(0)), plain


def test_an_echoed_micro_batch_takes_its_first_features_without_the_target(tmp_path):
    from dflash.placement.features import LocalFeatures, RecentBatches

    tokenizer = make_tiny_tokenizer()
    dataset = TokenDataset(prepare_dataset(write_chat_jsonl(tmp_path / "chats.jsonl", 8, 0), tokenizer,
                                           tmp_path / "shard", max_length=64))
    target = CountingTarget(tiny_causal_lm("qwen3", vocab_size=len(tokenizer) + 3).double(), [1, 3, 5])
    schedule, plain_steps = echoed_schedule(len(dataset), echo=3, span=2)
    got = list(LocalFeatures(target, dataset, 0, False, recent=RecentBatches(2)).batches(iter(schedule)))
    assert len(got) == 3 * plain_steps and plain_steps >= 3
    assert target.calls == plain_steps  # one forward per distinct micro-batch
    first_seen = {}
    for step, indices, batch in got:
        key = tuple(indices)
        assert batch.reused == (key in first_seen)
        if key in first_seen:
            assert batch.features is first_seen[key].features  # the very tensors, not a recomputation
        else:
            first_seen[key] = batch
    # without RecentBatches every step runs the target
    list(LocalFeatures(target, dataset, 0, False).batches(iter(schedule)))
    assert target.calls == plain_steps + len(schedule)


def test_split_placement_requests_an_echoed_micro_batch_once():
    from dflash.placement.features import RecentBatches, RemoteFeatures
    from dflash.placement.transport.wire import FeatureBatch

    class Client:  # answers in request order, as the transport does; credit 2
        def __init__(self):
            self.requests, self.waiting = [], []

        def free_credit(self):
            return 2 - len(self.waiting)

        def submit(self, step, indices):
            self.requests.append(list(indices))
            self.waiting.append(step)

        def receive(self, step):
            assert self.waiting.pop(0) == step
            ids = torch.tensor([[step]])
            return FeatureBatch(ids, ids > 0, torch.full((1, 1, 2), float(step)), target_rank=1)

    schedule, plain_steps = echoed_schedule(8, echo=2, span=2)
    schedule.insert(3, (99, []))  # a step this rank has no samples for
    client = Client()
    got = list(RemoteFeatures(client, torch.device("cpu"), RecentBatches(2)).batches(iter(schedule)))
    assert len(client.requests) == plain_steps
    assert [step for step, _, _ in got] == [step for step, _ in schedule]
    first = {}
    for step, indices, batch in got:
        if not indices:
            assert batch is None
            continue
        key = tuple(indices)
        if key in first:  # an echo: the features computed for the first step of these samples
            assert batch.reused and float(batch.features[0, 0, 0]) == first[key]
        else:
            assert not batch.reused and float(batch.features[0, 0, 0]) == step
            first[key] = step
