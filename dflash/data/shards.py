"""The files of a prepared shard directory and its manifest (written last: its presence marks
a complete shard): ids.bin, loss_mask.bin, offsets.npy, lengths.npy, manifest.json,
bad_samples.txt.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dflash.data.chat_formats import DataError


FORMAT_VERSION = 1

BAD_SAMPLES_FILE = "bad_samples.txt"

MANIFEST = "manifest.json"
IDS_FILE = "ids.bin"
LOSS_MASK_FILE = "loss_mask.bin"
OFFSETS_FILE = "offsets.npy"
LENGTHS_FILE = "lengths.npy"


@dataclass
class PrepareStats:
    """What prepare_dataset did with the samples of one file."""

    samples_read: int = 0  # lines
    samples_kept: int = 0  # sequences written (a conversation split by turn gives several)
    samples_truncated: int = 0  # kept, but cut at max_length
    samples_dropped: int = 0  # too long under "drop", or no loss token left after truncation
    samples_bad: int = 0  # skipped under --on-bad-sample skip, listed in bad_samples.txt
    samples_cut: int = 0  # replies cut at the regeneration's length limit (finish_reason "length")
    samples_cut_dropped: int = 0  # of those, dropped under --cut-replies drop
    samples_split_by_turn: int = 0  # trained as one sequence per assistant turn (conversation_sequences)
    bad_reasons: dict[str, int] = field(default_factory=dict)
    num_tokens: int = 0
    num_loss_tokens: int = 0


def write_index_and_manifest(
    staging: Path, lengths: list[int], stats: PrepareStats, settings: dict[str, Any]
) -> None:
    lengths_arr = np.asarray(lengths, dtype=np.int64)
    offsets = np.zeros_like(lengths_arr)
    np.cumsum(lengths_arr[:-1], out=offsets[1:])
    np.save(staging / OFFSETS_FILE, offsets)
    np.save(staging / LENGTHS_FILE, lengths_arr)
    manifest = {
        **settings,
        "num_samples": stats.samples_kept,
        "num_tokens": stats.num_tokens,
        "stats": asdict(stats),
    }
    # The manifest goes last: its presence marks a complete shard.
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def read_manifest(shard_dir: Path) -> dict[str, Any]:
    path = shard_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except OSError as err:
        raise DataError(f"{path}: no readable manifest ({err}); prepare the data first "
                        "(prepare_dataset) or point to a prepared-data directory") from err
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: manifest is not valid JSON; delete {shard_dir} and "
                        "prepare the data again") from err
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        found = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise DataError(f"{path}: data format version {found!r}, this code reads "
                        f"{FORMAT_VERSION}; delete {shard_dir} and prepare the data again")
    if not all(isinstance(manifest.get(key), int) for key in ("num_samples", "num_tokens")):
        raise DataError(f"{path}: manifest lacks num_samples/num_tokens; delete {shard_dir} "
                        "and prepare the data again")
    return manifest


def check_data_files(shard_dir: Path, manifest: dict[str, Any]) -> None:
    """The data files must exist with exactly the sizes the manifest promises."""
    expected = {IDS_FILE: 4 * manifest["num_tokens"], LOSS_MASK_FILE: manifest["num_tokens"]}
    for name, size in expected.items():
        path = shard_dir / name
        if not path.is_file() or path.stat().st_size != size:
            raise DataError(f"{path}: missing or not {size} bytes as the manifest says; "
                            f"delete {shard_dir} and prepare the data again")
    for name in (OFFSETS_FILE, LENGTHS_FILE):
        if not (shard_dir / name).is_file():
            raise DataError(f"{shard_dir / name}: missing; delete {shard_dir} and prepare "
                            "the data again")
