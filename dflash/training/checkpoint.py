"""Asynchronous, atomic checkpoints of the drafter ranks, and exact resume.

Layout under <output_dir>/checkpoints/:
  step_<N>/            DeepSpeed engine files (weights, ZeRO-sharded optimizer, LR schedule),
                       rng_rank<r>.pt per drafter rank, trainer_state.json (written LAST)
  .step_<N>.tmp/       a save in progress; never resumed from, cleared by the next save
  .universal/step_<N>/ the same state unsharded (DeepSpeed's universal layout), made when a run
                       resumes on another number of drafter ranks
A save pauses the step loop only while DeepSpeed hands its state dicts over: they are copied to
host memory (HostSnapshots) instead of being written. A writer thread then writes and flushes
every file and marks this rank done; drafter rank 0's writer waits for every rank's mark,
writes trainer_state.json, renames the folder to step_<N> and keeps the newest --keep-checkpoints.
At most one save is in flight: the next one (or the end of the run) waits for it, and raises
its error there. Target ranks hold no training state and take no part.
--resume takes the newest step_<N> that is intact (checkpoint_problem): newer ones whose files
were cut short afterwards (a full disk, an interrupted copy) are named and skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import threading
import time
import zipfile
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from dflash.util.files import fsync_dir, replace_dir, storage_error, write_text_durably

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
UNIVERSAL_DIR = ".universal"  # resharding copies; not matched by the step_N listing
PEERS_TIMEOUT_S = 3600.0  # rank 0 waits this long for the other ranks' files of one save


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or committed; the message says where and what to do."""


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def _to_host(obj: Any) -> Any:
    """A copy of a state dict whose tensors live in host memory (training goes on in place)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((key, _to_host(value)) for key, value in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(value) for value in obj)
    return obj


class SnapshotCheckpointEngine:
    """Takes the place of DeepSpeed's checkpoint engine (same methods): save() keeps a host
    copy of each file's state instead of writing it; take() hands the copies to the writer."""

    name = "SnapshotCheckpointEngine"

    def __init__(self) -> None:
        self._files: list[tuple[Path, Any]] = []

    def save(self, state_dict, path: str) -> None:
        self._files.append((Path(path), _to_host(state_dict)))

    def take(self) -> list[tuple[Path, Any]]:
        files, self._files = self._files, []
        return files

    def load(self, path: str, map_location=None):
        return torch.load(path, map_location=map_location, weights_only=False)

    def makedirs(self, path, exist_ok: bool = False) -> None:
        Path(path).mkdir(parents=True, exist_ok=exist_ok)

    def create(self, info) -> None:
        pass

    def commit(self, info) -> bool:
        return True

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        return False

    def preserves_storage_sharing(self) -> bool:
        return True

    def cleanup(self) -> None:
        pass


@contextlib.contextmanager
def barriers_within(group) -> Iterator[None]:
    """DeepSpeed's save_checkpoint waits at barriers of the WORLD group; in split placement the
    target ranks never reach them. For the save, a barrier without a group means `group`."""
    import deepspeed.comm as ds_comm  # not at import time: DeepSpeed reads DS_ACCELERATOR then

    original = ds_comm.barrier

    def barrier(group_=None, *args, **kwargs):
        return original(group_ if group_ is not None else group, *args, **kwargs)

    ds_comm.barrier = barrier
    try:
        yield
    finally:
        ds_comm.barrier = original


def save_due(step: int, every: int, minutes: float, seconds_since_save: float) -> bool:
    """Whether a periodic checkpoint is due after optimizer step `step`: every `every` steps, or
    once `minutes` have passed since the last one (0 turns either clock off)."""
    return (every > 0 and step % every == 0) or (minutes > 0 and seconds_since_save >= 60 * minutes)


class Checkpointer:
    """An asynchronous save of the drafter ranks whenever one is due: every `every` optimizer
    steps, or every `minutes` of training. Collective over the drafter group: every drafter rank
    asks `due` at the same steps, and with a time set they agree on whether a
    save is due (the earliest clock decides), so none waits at a save the others skip. `clock`
    (seconds) is for tests."""

    def __init__(self, engine, output_dir: str | Path, every: int, keep: int, drafter_rank: int,
                 num_drafters: int, group, minutes: float = 0.0, clock=time.monotonic) -> None:
        self.engine, self.root = engine, checkpoint_dir(output_dir)
        self.every, self.keep, self.rank, self.num_drafters, self.group = every, keep, drafter_rank, num_drafters, group
        self.minutes, self._clock = minutes, clock
        self._last_save = clock()
        self._snapshots = SnapshotCheckpointEngine()
        engine.checkpoint_engine = self._snapshots
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        self._commit_lock = threading.Lock()
        self._cancelled = False
        self.pauses_s: list[float] = []  # how long each save held the step loop

    def due(self, step: int) -> bool:
        """Whether a save is due after optimizer step `step`, as every drafter rank agrees."""
        due = save_due(step, self.every, self.minutes, self._clock() - self._last_save)
        # steps alone, or one rank: nothing to agree on, and no device flag whose read would stall
        # the step loop until the GPU drains
        if self.minutes <= 0 or self.num_drafters == 1:
            return due
        flag = torch.tensor([1.0 if due else 0.0], device=next(self.engine.module.parameters()).device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item() > 0)

    def save(self, step: int, trainer_state: dict) -> None:
        started = time.perf_counter()
        self._last_save = self._clock()
        self.wait()
        if not self._weights_finite():
            logger.error("step %d: the drafter's weights hold NaN/inf; not saving them (the checkpoint before "
                         "stays the newest)", step)
            return
        staging = self.root / f".step_{step}.tmp"
        if self.rank == 0:
            self._clear_unfinished()
        dist.barrier(group=self.group)
        with barriers_within(self.group):
            self.engine.save_checkpoint(str(self.root), tag=staging.name, save_latest=False)
        files = self._snapshots.take()
        files.append((staging / f"rng_rank{self.rank}.pt", _rng_state()))
        self._writer = threading.Thread(target=self._write, args=(step, staging, files, dict(trainer_state)),
                                        name=f"checkpoint-step-{step}", daemon=True)
        self._writer.start()
        self.pauses_s.append(time.perf_counter() - started)

    def wait(self) -> None:
        """Until the save in flight is committed (on rank 0) or written (others); raises its error."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(str(error)) from error

    def cancel(self) -> None:
        """No save commits once this returns (one committing now finishes first): an interrupted
        run names its newest checkpoint, and that must stay the newest."""
        with self._commit_lock:
            self._cancelled = True

    def _weights_finite(self) -> bool:
        params = list(self.engine.module.parameters())
        # one device-side reduction and one host read, not one sync per parameter
        flag = torch.stack([torch.isfinite(p).all() for p in params]).all().float().reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item() > 0)

    def _clear_unfinished(self) -> None:
        for stale in self.root.glob(".step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)

    def _write(self, step: int, staging: Path, files: list[tuple[Path, Any]], trainer_state: dict) -> None:
        intact = f"the newest complete checkpoint ({latest_checkpoint(self.root.parent) or 'none yet'}) is intact"
        path = staging
        try:
            for path, state in files:
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(state, path)
            path = staging / f".done_rank{self.rank}"
            path.write_text("")
            if self.rank == 0:
                self._commit(step, staging, trainer_state)
        except OSError as err:
            self._error = storage_error(err, path, intact)
        except BaseException as err:  # handed to the step loop, which raises it at the next wait()
            self._error = err

    def _commit(self, step: int, staging: Path, trainer_state: dict) -> None:
        deadline = time.monotonic() + PEERS_TIMEOUT_S
        marks = [staging / f".done_rank{r}" for r in range(self.num_drafters)]
        while not all(mark.exists() for mark in marks):
            if time.monotonic() > deadline:
                missing = [r for r, mark in enumerate(marks) if not mark.exists()]
                raise CheckpointError(f"step {step}: drafter ranks {missing} did not finish their part of the "
                                      f"checkpoint in {PEERS_TIMEOUT_S:g} s; see their logs")
            time.sleep(0.05)
        for mark in marks:
            mark.unlink()
        final = self.root / f"step_{step}"
        with self._commit_lock:
            if self._cancelled:
                return
            write_text_durably(staging / STATE_FILE, json.dumps(trainer_state, indent=2) + "\n")
            replace_dir(staging, final)
        logger.info("checkpoint %s saved", final)
        for old in _complete_checkpoints(self.root)[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
            shutil.rmtree(self.root / UNIVERSAL_DIR / old.name, ignore_errors=True)
        fsync_dir(self.root)


def _rng_state() -> dict:
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def _complete_checkpoints(root: Path) -> list[Path]:
    """Complete step directories, oldest first."""
    complete = [p for p in root.glob("step_*") if (p / STATE_FILE).is_file()]
    return sorted(complete, key=lambda p: int(p.name.removeprefix("step_")))


def checkpoint_problem(path: Path) -> str | None:
    """What makes the complete checkpoint at `path` unusable (a file cut short by a full disk or an
    interrupted copy), or None. Cheap: torch.save writes a zip whose directory comes last, so a
    truncated .pt file has none; the weights themselves are not read."""
    try:
        json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as err:
        return f"{STATE_FILE} is truncated or corrupt ({err})"
    for file in sorted(path.glob("*.pt")):
        try:
            with zipfile.ZipFile(file):
                pass
        except (OSError, zipfile.BadZipFile) as err:
            return f"{file.name} is truncated or corrupt ({err})"
    return None


def newest_intact_checkpoint(output_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint without a checkpoint_problem (or None), and what is wrong with
    each newer one ("step_8: ...")."""
    skipped = []
    for path in reversed(_complete_checkpoints(checkpoint_dir(output_dir))):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append(f"{path.name}: {problem}")
    return None, skipped


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest COMPLETE and intact step directory, or None."""
    return newest_intact_checkpoint(output_dir)[0]


def saved_batching(path: Path) -> dict:
    """The sampler settings the checkpoint at `path` was written with (num_replicas: its drafter
    ranks; max_draft_positions when a draft budget applied)."""
    return json.loads((path / STATE_FILE).read_text())["sampler"]["fingerprint"]


def saved_recipe(path: Path) -> dict | None:
    """The recipe flags the checkpoint at `path` was written with (None: it records none)."""
    return json.loads((path / STATE_FILE).read_text()).get("recipe")


def saved_drafter_ranks(path: Path) -> int:
    return int(saved_batching(path)["num_replicas"])


def universal_copy(path: Path, group) -> Path:
    """The checkpoint at `path` in DeepSpeed's universal layout (full, unsharded fp32 weights and
    Adam moments per parameter), which loads onto any number of ranks. Drafter rank 0 converts
    it once into checkpoints/.universal/step_N (atomically); the others wait."""
    target = path.parent / UNIVERSAL_DIR / path.name
    if dist.get_rank(group) == 0 and not target.is_dir():
        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

        staging = target.parent / f".{path.name}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        started = time.perf_counter()
        ds_to_universal(argparse.Namespace(
            input_folder=str(path), output_folder=str(staging), num_extract_workers=1, num_merge_workers=1,
            keep_temp_folder=False, strict=True, inject_missing_state=True))
        replace_dir(staging, target)
        logger.info("converted %s to the universal layout in %.1f s (%s)", path, time.perf_counter() - started,
                    target)
    dist.barrier(group=group)
    return target


def load_checkpoint(engine, path: Path, drafter_rank: int, num_drafters: int, seed: int, group=None) -> dict:
    """Restore engine, optimizer, LR schedule and this rank's RNG; return the trainer state.

    Written by another number of drafter ranks, the ZeRO-sharded state is loaded from its
    universal copy (the engine must have been built with checkpoint.load_universal, see
    train.deepspeed_config) and ranks without an RNG file of their own are seeded from
    (seed, step, rank)."""
    state = json.loads((path / STATE_FILE).read_text())
    saved = saved_drafter_ranks(path)
    if saved == num_drafters:
        engine.load_checkpoint(str(path.parent), tag=path.name)
    else:
        universal = universal_copy(path, group)
        engine.load_checkpoint(str(universal.parent), tag=universal.name)
        logger.info("checkpoint of %d drafter ranks resharded onto %d", saved, num_drafters)
    rng_file = path / f"rng_rank{drafter_rank}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:
        torch.manual_seed((seed * 1_000_003 + engine.global_steps) * 1_009 + drafter_rank)
    return state
