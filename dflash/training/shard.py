"""The training shard of a run: <output-dir>/data/train, prepared from the run's flags (reused
when already prepared with them). The run (dflash/training/run.py) and
`python -m dflash.tools.data prepare|stats` both go through here.
"""

from __future__ import annotations

from pathlib import Path

from dflash.config import RunConfig
from dflash.data.prepare import prepare_dataset


def train_shard_dir(config: RunConfig) -> Path:
    return Path(config.train.output_dir) / "data" / "train"


def prepare_train_shard(config: RunConfig, tokenizer, thinking: str) -> Path:
    """The training shard for these flags and the resolved thinking mode (reused when already
    prepared with them)."""
    d = config.data
    return prepare_dataset(d.train_data, tokenizer, train_shard_dir(config), max_length=d.max_length,
                           overflow=d.overflow, on_bad_sample=d.on_bad_sample, max_bad_fraction=d.max_bad_fraction,
                           workers=d.prepare_workers, loss_turns=d.loss_turns, thinking=thinking,
                           cut_replies=d.cut_replies)
