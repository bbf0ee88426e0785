"""A prepared shard read back: TokenDataset (memory-mapped samples) and collate (right-padded
batches); dflash/data/sampler.py picks the indices.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dflash.data.chat_formats import DataError
from dflash.data.shards import IDS_FILE, LENGTHS_FILE, LOSS_MASK_FILE, OFFSETS_FILE, check_data_files, read_manifest


class TokenDataset:
    """Read-only, memory-mapped samples of a prepared shard directory."""

    def __init__(self, shard_dir: str | Path) -> None:
        self.shard_dir = Path(shard_dir)
        self.manifest = read_manifest(self.shard_dir)
        check_data_files(self.shard_dir, self.manifest)
        num_tokens = self.manifest["num_tokens"]
        self._ids = np.memmap(self.shard_dir / IDS_FILE, dtype=np.int32, mode="r", shape=(num_tokens,))
        self._mask = np.memmap(
            self.shard_dir / LOSS_MASK_FILE, dtype=np.uint8, mode="r", shape=(num_tokens,)
        )
        self._offsets = np.load(self.shard_dir / OFFSETS_FILE)
        self._lengths = np.load(self.shard_dir / LENGTHS_FILE)
        if len(self._lengths) != self.manifest["num_samples"] or len(self._offsets) != len(self._lengths):
            raise DataError(f"{self.shard_dir}: index files disagree with the manifest; "
                            "delete it and prepare the data again")

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Return (token ids int64, loss mask bool) of one sample, copied out of the memmap."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        start = int(self._offsets[index])
        stop = start + int(self._lengths[index])
        return self._ids[start:stop].astype(np.int64), self._mask[start:stop].astype(bool)

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths

    def reply_token_counts(self, vocab_size: int, chunk_tokens: int = 1 << 26) -> np.ndarray:
        """How often each token id is a reply token (in the loss mask), over every sample, read in
        chunks so that a corpus of billions of tokens needs no more memory than a chunk."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        for start in range(0, len(self._ids), chunk_tokens):
            ids = np.asarray(self._ids[start:start + chunk_tokens])
            counts += np.bincount(ids[np.asarray(self._mask[start:start + chunk_tokens], dtype=bool)],
                                  minlength=vocab_size)[:vocab_size]
        return counts

    def anchor_candidates(self, chunk_tokens: int = 1 << 26) -> np.ndarray:
        """Per sample, how many positions could anchor a block (loss mask at a and a+1, as
        `objective.anchor_candidates`), read in chunks of whole samples so a corpus of billions
        of tokens needs no more memory than a chunk."""
        counts = np.zeros(len(self), dtype=np.int64)
        ends = self._offsets + self._lengths
        first = 0
        while first < len(self):
            start = int(self._offsets[first])
            last = int(np.searchsorted(ends, start + chunk_tokens, side="right"))
            last = max(last, first + 1)
            stop = int(ends[last - 1])
            mask = np.asarray(self._mask[start:stop], dtype=bool)
            pairs = np.concatenate([mask[:-1] & mask[1:], [False]]) if len(mask) else mask
            # a pair across two samples is no candidate: the last token of each sample starts none
            pairs[(ends[first:last] - 1 - start)[self._lengths[first:last] > 0]] = False
            sums = np.concatenate([[0], np.cumsum(pairs, dtype=np.int64)])
            counts[first:last] = sums[ends[first:last] - start] - sums[self._offsets[first:last] - start]
            first = last
        return counts


def collate(dataset: TokenDataset, indices: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad the given samples into a batch of tensors."""
    if not indices:
        raise ValueError("collate needs at least one sample index")
    samples = [dataset[i] for i in indices]
    lengths = torch.tensor([len(ids) for ids, _ in samples], dtype=torch.long)
    width = int(lengths.max())
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(samples), width), dtype=torch.bool)
    for row, (ids, mask) in enumerate(samples):
        input_ids[row, : len(ids)] = torch.from_numpy(ids)
        loss_mask[row, : len(mask)] = torch.from_numpy(mask)
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "attention_mask": torch.arange(width)[None, :] < lengths[:, None],
        "lengths": lengths,
        "sample_ids": torch.tensor(indices, dtype=torch.long),
    }
