"""Where a drafter rank gets each micro-batch's target features from.

Colocated: this rank runs the frozen target itself. Split: a target rank runs it and the
features arrive over point-to-point transfers, requested ahead of time (up to the credit) so
transfer and target compute overlap the drafter's step. Both hand out batches in the drafter's
own step order, so the data a drafter sees does not depend on which rank computed it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch

from dflash.data.dataset import TokenDataset, collate
from dflash.placement.transport import DrafterClient, FeatureBatch
from dflash.target.frozen import FrozenTarget
from dflash.util.phases import PhaseClock


def compute_features(target: FrozenTarget, dataset: TokenDataset, indices: list[int], pad_id: int,
                     with_final_hidden: bool, clock: PhaseClock | None = None) -> FeatureBatch:
    """Collate `indices` and run the frozen target over them."""
    batch = collate(dataset, indices, pad_id)
    input_ids = batch["input_ids"].to(target.device)
    if clock is not None:
        clock.mark("data")
    out = target.features(input_ids, with_final_hidden=with_final_hidden)
    if clock is not None:
        clock.mark("target_forward")
    return FeatureBatch(input_ids, batch["loss_mask"].to(target.device), out.features, out.final_hidden)


class LocalFeatures:
    """Colocated: the target lives on this rank."""

    def __init__(self, target: FrozenTarget, dataset: TokenDataset, pad_id: int, with_final_hidden: bool):
        self.target, self.dataset, self.pad_id = target, dataset, pad_id
        self.with_final_hidden = with_final_hidden

    def batches(self, schedule: Iterator[tuple[int, list[int]]],
                clock: PhaseClock | None = None) -> Iterator[tuple[int, list[int], FeatureBatch | None]]:
        """(step, indices, batch) in schedule order; batch is None where this rank got no samples.
        `clock` is told where collation ends and the target forward ends."""
        for step, indices in schedule:
            if not indices:
                yield step, indices, None
                continue
            yield step, indices, compute_features(self.target, self.dataset, indices, self.pad_id,
                                                  self.with_final_hidden, clock)

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

    def __init__(self, client: DrafterClient, device: torch.device):
        self.client = client
        self.device = device
        self.served_by: dict[int, int] = {}  # target rank -> micro-batches it computed for us

    def batches(self, schedule: Iterator[tuple[int, list[int]]],
                clock: PhaseClock | None = None) -> Iterator[tuple[int, list[int], FeatureBatch | None]]:
        """(step, indices, batch) in schedule order; batch is None where this rank got no samples.
        `clock` is told when the features are here (the wait for them counts as data)."""
        pending: deque[tuple[int, list[int]]] = deque()  # requested or empty steps, in the drafter's order
        schedule = iter(schedule)
        exhausted = False
        while True:
            while not exhausted and self.client.free_credit() > 0:
                item = next(schedule, None)
                if item is None:
                    exhausted = True
                    break
                step, indices = item
                if indices:
                    self.client.submit(step, indices)
                pending.append((step, indices))
            if not pending:
                return
            step, indices = pending.popleft()
            if not indices:
                yield step, indices, None
                continue
            got = self.client.receive(step)
            self.served_by[got.target_rank] = self.served_by.get(got.target_rank, 0) + 1
            batch = got.to(self.device)
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
