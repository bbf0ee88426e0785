"""How fast the CPU turns a token shard into micro-batches ready for the GPU (no GPU needed).

    python -m dflash.benchmarks.data                      # 20,000 samples, recipe batching, 1 and 8 ranks
    python -m dflash.benchmarks.data --max-tokens 3072 --shard runs/x/data --output /tmp/data.json
    python -m dflash.benchmarks.data --samples 2000 --prepare-samples 3000   # + data preparation rate

Data: a shard prepared by prepare_dataset (--shard), else a synthetic one in a temporary folder
written with dflash/data/shards.py's shard writer (ids.bin, loss_mask.bin, index + manifest), read by
TokenDataset as in training (from the page cache, since it was just written): lengths uniform
in [--min-length, --max-length] (default 386-2864, the 8B benchmark mix of BENCHMARKS.md),
random ids, loss mask off on a 60-250 token prompt. For each --replicas count it times
(a) planning one epoch (set_epoch + steps_per_epoch; DEFAULT_BUCKETS, --max-tokens), median
of --plan-epochs; (b) rank_batches(r) + collate (+ pin_memory, default only where CUDA is
available) of every micro-batch of every rank of one epoch.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dflash.config import DEFAULT_BUCKETS
from dflash.data.dataset import TokenDataset, collate
from dflash.data.prepare import usable_cores
from dflash.data.sampler import RankAwareBucketSampler
from dflash.data.shards import FORMAT_VERSION, IDS_FILE, LOSS_MASK_FILE, PrepareStats, write_index_and_manifest
from dflash.util.cli import cli_parser


@dataclass
class DataBenchArgs:
    samples: int = 20_000
    min_length: int = 386
    max_length: int = 2864
    vocab_size: int = 151_936
    max_tokens: int = 8192
    replicas: list[int] = field(default_factory=lambda: [1, 8])
    plan_epochs: int = 3
    pin_memory: bool | None = field(default=None, metadata={"help": "default: torch.cuda.is_available()"})
    shard: str | None = None  # a prepared shard folder instead of the synthetic one
    prepare_samples: int = 0  # > 0: also time prepare_dataset on this many realistic chats, 1 vs the default workers
    seed: int = 0
    output: str | None = None


def write_synthetic_shard(args: DataBenchArgs, folder: Path) -> None:
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_length, args.max_length + 1, args.samples)
    prompts = rng.integers(60, 251, args.samples)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    mask = (np.arange(int(lengths.sum())) - starts >= np.repeat(prompts, lengths)).astype(np.uint8)
    rng.integers(0, args.vocab_size, len(mask), dtype=np.int32).tofile(folder / IDS_FILE)
    mask.tofile(folder / LOSS_MASK_FILE)
    stats = PrepareStats(samples_read=args.samples, samples_kept=args.samples, num_tokens=len(mask),
                         num_loss_tokens=int(mask.sum()))
    write_index_and_manifest(folder, lengths.tolist(), stats, {"format_version": FORMAT_VERSION,
                                                                "source": "synthetic (dflash.benchmarks.data)"})


def time_epoch(dataset: TokenDataset, sampler: RankAwareBucketSampler, pin: bool) -> dict:
    """rank_batches + collate (+ pin) of every non-empty micro-batch of every rank, one epoch."""
    times, tokens, padded, empty = [], 0, 0, 0
    for rank in range(sampler.num_replicas):
        sampler.load_state_dict({**sampler.state_dict(), "position": 0})  # each rank from step 0
        started = time.perf_counter()  # each batch's time includes the sampler's yield
        for _, indices in sampler.rank_batches(rank):
            if indices:  # an empty one is a zero step in the trainer: no data to make
                batch = collate(dataset, indices, pad_id=0)
                if pin:
                    batch = {name: tensor.pin_memory() for name, tensor in batch.items()}
                times.append(time.perf_counter() - started)
                tokens += int(batch["lengths"].sum())
                padded += batch["input_ids"].numel()
            empty += not indices
            started = time.perf_counter()
    total = sum(times)
    return {"micro_batches": len(times), "empty_micro_batches": empty, "seconds": round(total, 3),
            "micro_batches_per_s": round(len(times) / total, 1), "seq_tokens_per_s": round(tokens / total),
            "padded_tokens_per_s": round(padded / total), "padding_fraction": round(1 - tokens / padded, 4),
            "batch_ms_median": round(float(np.median(times)) * 1e3, 3),
            "batch_ms_p99": round(float(np.percentile(times, 99)) * 1e3, 3)}


def time_preparation(args: DataBenchArgs, folder: Path) -> list[dict]:
    """prepare_dataset (tokenize with the chat template, loss mask, shard) on chats of 300-2600
    response tokens (dflash.benchmarks.assets, demo tokenizer), with one process and with the default workers."""
    from dflash.benchmarks.assets import AssetArgs, write_chats
    from dflash.data.tokenization import load_tokenizer
    from dflash.data.prepare import default_prepare_workers, prepare_dataset
    from dflash.demo import DEMO_TARGET_DIR

    chats = folder / "chats.jsonl"
    write_chats(AssetArgs(samples=args.prepare_samples, seed=args.seed), chats)
    tokenizer = load_tokenizer(str(DEMO_TARGET_DIR))
    rows = []
    for workers in sorted({1, default_prepare_workers(chats)}):
        started = time.perf_counter()
        shard = prepare_dataset(chats, tokenizer, folder / f"shard-{workers}", 3072, workers=workers)
        seconds = time.perf_counter() - started
        rate = args.prepare_samples / seconds
        rows.append({"workers": workers, "samples": args.prepare_samples, "seconds": round(seconds, 2),
                     "samples_per_s": round(rate, 1), "mean_tokens": round(float(TokenDataset(shard).lengths.mean())),
                     "minutes_for_902k": round(902_000 / rate / 60, 1)})
    return rows


def run(args: DataBenchArgs, shard: Path) -> dict:
    dataset = TokenDataset(shard)
    pin = torch.cuda.is_available() if args.pin_memory is None else args.pin_memory
    if pin and not torch.cuda.is_available():
        raise SystemExit("--pin-memory needs CUDA (pinned memory is a CUDA allocation); leave it off")
    result = {"samples": len(dataset), "seq_tokens": int(dataset.lengths.sum()),
              "length_min_max": [int(dataset.lengths.min()), int(dataset.lengths.max())],
              "max_tokens": args.max_tokens, "buckets": DEFAULT_BUCKETS, "pin_memory": pin,
              "cpu_count": usable_cores(), "torch": torch.__version__, "runs": []}
    for replicas in args.replicas:
        sampler = RankAwareBucketSampler(dataset.lengths, DEFAULT_BUCKETS, args.max_tokens, replicas, args.seed)
        plan_ms = []
        for epoch in range(1, args.plan_epochs + 1):  # epoch 0 is never planned twice: start at 1
            started = time.perf_counter()
            sampler.set_epoch(epoch)
            steps = sampler.steps_per_epoch()
            plan_ms.append((time.perf_counter() - started) * 1e3)
        result["runs"].append({"num_replicas": replicas, "steps": steps,
                               "plan_ms_per_epoch": round(float(np.median(plan_ms)), 1),
                               **time_epoch(dataset, sampler, pin)})
    return result


def main(argv: list[str] | None = None) -> dict:
    (args,) = cli_parser(DataBenchArgs).parse_args_into_dataclasses(argv)
    with tempfile.TemporaryDirectory(prefix="data-bench-") as tmp:
        if args.shard is None:
            write_synthetic_shard(args, Path(tmp))
        result = run(args, Path(args.shard or tmp))
        if args.prepare_samples:
            result["preparation"] = time_preparation(args, Path(tmp))
    print(json.dumps(result))
    print("; ".join(f"{r['num_replicas']} ranks: {r['steps']} steps, plan {r['plan_ms_per_epoch']} ms, "
                    f"{r['micro_batches_per_s']} batches/s, {r['seq_tokens_per_s']:,} seq tok/s, "
                    f"median {r['batch_ms_median']} ms, p99 {r['batch_ms_p99']} ms" for r in result["runs"])
          + f" ({result['samples']} samples, {result['cpu_count']} CPUs, torch {result['torch']})")
    for row in result.get("preparation", []):
        print(f"prepare: {row['workers']} process(es), {row['samples_per_s']} samples/s of {row['mean_tokens']} "
              f"tokens -> 902K samples in {row['minutes_for_902k']} min")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
