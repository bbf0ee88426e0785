"""The training loop's batch stream: it stops where the run is done, without fetching a batch
no step uses, also when the run is resumed from its final checkpoint."""

from __future__ import annotations

from types import SimpleNamespace

from dflash.training.run import epoch_batches


class Run(SimpleNamespace):
    """Just what epoch_batches reads of a DrafterRun; a step is one batch here."""

    @property
    def finished(self) -> bool:
        return self.steps_done >= self.total_steps


def stream(run: Run, epochs: int = 2, batches_per_epoch: int = 3) -> list[tuple[int, int]]:
    ctx = SimpleNamespace(config=SimpleNamespace(train=SimpleNamespace(epochs=epochs)))
    sampler = SimpleNamespace(set_epoch=lambda epoch: None, rank_batches=lambda rank: range(batches_per_epoch),
                              anchor_draw=lambda step: (step, 0))
    fetched = []

    def batches(steps, clock):  # counts what was fetched: in split placement, requests to a target rank
        for i in steps:
            fetched.append(i)
            yield i, [i], f"batch {i}"

    run.sampler, run.drafter_rank = sampler, 0
    seen = []
    for epoch, batch_step, _, _, _ in epoch_batches(ctx, run, SimpleNamespace(batches=batches), clock=None):
        seen.append((epoch, batch_step))
        run.steps_done += 1
    assert len(fetched) == len(seen), "a batch was fetched that no step used"
    return seen


def test_the_stream_ends_at_the_planned_step_count():
    assert stream(Run(start_epoch=0, steps_done=0, total_steps=4)) == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert len(stream(Run(start_epoch=0, steps_done=0, total_steps=100))) == 6  # the epochs end first


def test_a_run_resumed_from_its_final_checkpoint_trains_nothing_more():
    assert stream(Run(start_epoch=1, steps_done=4, total_steps=4)) == []
