"""Where a drafter rank gets each micro-batch's target features from.

Colocated: this rank runs the frozen target itself. Split: a target rank runs it and the
features arrive over point-to-point transfers, requested ahead of time (up to the credit) so
transfer and target compute overlap the drafter's step. Both hand out batches in the drafter's
own step order, so the data a drafter sees does not depend on which rank computed it. With
--reuse-features, a micro-batch the sampler repeats takes the features it had the first time
(RecentBatches): neither the colocated target nor a target rank runs it again.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from collections.abc import Iterator

import torch

from dflash.data.dataset import TokenDataset, collate
from dflash.placement.transport import DrafterClient, FeatureBatch
from dflash.target.frozen import FrozenTarget
from dflash.target.length_groups import plan_length_groups
from dflash.util.phases import PhaseClock
from dflash.util.runtime import to_device_async


class FeatureCache:
    """Each sample's target features from the first time the target computed them, unpadded, on
    the device that computed them (`--cache-target-features`). A run of several epochs then runs
    the target once per sample instead of once per epoch: on a CPU, or with a target as small as
    the drafter, that forward is most of a step. Padding positions come back as zeros: no block
    attends past its own sequence, so they are never read."""

    def __init__(self) -> None:
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def store(self, indices: list[int], lengths: torch.Tensor, features: torch.Tensor,
              final_hidden: torch.Tensor | None) -> None:
        for row, (index, length) in enumerate(zip(indices, lengths.tolist())):
            final = final_hidden[row, :length].clone() if final_hidden is not None else None
            self._rows[index] = (features[row, :length].clone(), final)

    def lookup(self, indices: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Padded [b, width, F] features (and final hidden states) if every sample is cached."""
        rows = [self._rows.get(i) for i in indices]
        if any(r is None for r in rows):
            return None
        features = rows[0][0].new_zeros(len(rows), width, rows[0][0].shape[-1])
        finals = None if rows[0][1] is None else rows[0][1].new_zeros(len(rows), width, rows[0][1].shape[-1])
        for row, (feature, final) in enumerate(rows):
            features[row, : len(feature)] = feature
            if finals is not None:
                finals[row, : len(final)] = final
        return features, finals


class RecentBatches:
    """The features of the last `span` micro-batches (one optimizer step's), by their sample ids:
    the sampler's echo of a micro-batch (--reuse-features) follows within that many."""

    def __init__(self, span: int):
        self.span = span
        self._batches: OrderedDict[tuple[int, ...], FeatureBatch] = OrderedDict()

    def get(self, indices: list[int]) -> FeatureBatch | None:
        batch = self._batches.get(tuple(indices))
        return None if batch is None else dataclasses.replace(batch, reused=True)

    def put(self, indices: list[int], batch: FeatureBatch) -> None:
        self._batches[tuple(indices)] = batch
        while len(self._batches) > self.span:
            self._batches.popitem(last=False)


def compute_features(target: FrozenTarget, dataset: TokenDataset, indices: list[int], pad_id: int,
                     with_final_hidden: bool, clock: PhaseClock | None = None,
                     cache: FeatureCache | None = None, length_groups: int = 1) -> FeatureBatch:
    """Collate `indices` and run the frozen target over them (or take them from `cache`), in up to
    `length_groups` groups of rows of about one length (dflash/target/length_groups.py)."""
    batch = collate(dataset, indices, pad_id)
    cached = cache.lookup(indices, batch["input_ids"].shape[1]) if cache is not None else None
    planned = cached is None and length_groups > 1
    groups = plan_length_groups(batch["lengths"].numpy(), length_groups) if planned else []
    # from pinned memory, so that the host queues the target's forward without waiting for the
    # previous step's work; every copy before the forward: one queued behind it waits for all of it
    input_ids = to_device_async(batch["input_ids"], target.device)
    loss_mask = to_device_async(batch["loss_mask"], target.device)
    rows = [torch.from_numpy(g.rows) for g in groups] if len(groups) > 1 else []
    parts = [(to_device_async(batch["input_ids"][r, :g.width], target.device), to_device_async(r, target.device))
             for r, g in zip(rows, groups)]
    if clock is not None:
        clock.mark("data")
    reused = cached is not None
    if cached is None:
        out = (target.features_by_length(parts, tuple(input_ids.shape), with_final_hidden=with_final_hidden)
               if parts else target.features(input_ids, with_final_hidden=with_final_hidden, lengths=batch["lengths"]))
        cached = out.features, out.final_hidden
        if cache is not None:
            cache.store(indices, batch["lengths"], *cached)
    if clock is not None:
        clock.mark("target_forward")
    return FeatureBatch(input_ids, loss_mask, *cached, reused=reused)


class LocalFeatures:
    """Colocated: the target lives on this rank."""

    def __init__(self, target: FrozenTarget, dataset: TokenDataset, pad_id: int, with_final_hidden: bool,
                 cache: FeatureCache | None = None, recent: RecentBatches | None = None, length_groups: int = 1):
        self.target, self.dataset, self.pad_id = target, dataset, pad_id
        self.with_final_hidden, self.cache, self.recent = with_final_hidden, cache, recent
        self.length_groups = length_groups

    def batches(self, schedule: Iterator[tuple[int, list[int]]],
                clock: PhaseClock | None = None) -> Iterator[tuple[int, list[int], FeatureBatch | None]]:
        """(step, indices, batch) in schedule order; batch is None where this rank got no samples.
        `clock` is told where collation ends and the target forward ends."""
        for step, indices in schedule:
            if not indices:
                yield step, indices, None
                continue
            batch = self.recent.get(indices) if self.recent is not None else None
            if batch is None:
                batch = compute_features(self.target, self.dataset, indices, self.pad_id, self.with_final_hidden,
                                         clock, self.cache, self.length_groups)
                if self.recent is not None:
                    self.recent.put(indices, batch)
            yield step, indices, batch

    def queue_depths(self) -> dict[int, int]:
        return {}

    @property
    def served_by(self) -> dict[int, int]:
        return {}

    def stop(self) -> None:
        pass

    def close(self) -> None:
        pass


class RemoteFeatures:
    """Split: requests go out ahead of use, as far as the credit allows."""

    def __init__(self, client: DrafterClient, device: torch.device, recent: RecentBatches | None = None):
        self.client = client
        self.device = device
        self.recent = recent
        self.served_by: dict[int, int] = {}  # target rank -> micro-batches it computed for us

    def batches(self, schedule: Iterator[tuple[int, list[int]]],
                clock: PhaseClock | None = None) -> Iterator[tuple[int, list[int], FeatureBatch | None]]:
        """(step, indices, batch) in schedule order; batch is None where this rank got no samples.
        `clock` is told when the features are here (the wait for them counts as data)."""
        pending: deque[tuple[int, list[int], bool]] = deque()  # (step, indices, an echo): in the drafter's order
        submitted: deque[tuple[int, ...]] = deque(maxlen=self.recent.span if self.recent is not None else 0)
        schedule = iter(schedule)
        exhausted = False
        while True:
            while not exhausted and self.client.free_credit() > 0:
                item = next(schedule, None)
                if item is None:
                    exhausted = True
                    break
                step, indices = item
                echo = bool(indices) and tuple(indices) in submitted  # answered before it: FIFO
                if indices and not echo:
                    self.client.submit(step, indices)
                    submitted.append(tuple(indices))
                pending.append((step, indices, echo))
            if not pending:
                return
            step, indices, echo = pending.popleft()
            if not indices:
                yield step, indices, None
                continue
            if echo:
                yield step, indices, self.recent.get(indices)
                continue
            got = self.client.receive(step)
            self.served_by[got.target_rank] = self.served_by.get(got.target_rank, 0) + 1
            batch = got.to(self.device)
            if self.recent is not None:
                self.recent.put(indices, batch)
            if clock is not None:
                clock.mark("data")
            yield step, indices, batch

    def queue_depths(self) -> dict[int, int]:
        return self.client.queue_depths()

    def stop(self) -> None:
        """No more batches: the targets answer what was sent and finish, without waiting on us."""
        self.client.stop()

    def close(self) -> None:
        """Wait for what was sent to be answered (bounded by --transport-timeout-s)."""
        self.client.close()


FeatureSource = LocalFeatures | RemoteFeatures
