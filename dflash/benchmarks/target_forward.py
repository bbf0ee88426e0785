"""The target's training forward (FrozenTarget.features) over micro-batches of a new shape each,
as training feeds it: ms a forward and prompt tokens/s, with the attention backends it uses
(flash, efficient, math) and with cuDNN's allowed too, which plans anew for every new shape.

    python -m dflash.benchmarks.target_forward --target model.gguf --max-tokens 32768 --steps 30

Each micro-batch holds max-tokens // S rows of a length S drawn between --min-length and
--max-length (a fresh draw for each backend set, so each sees shapes it has not planned for);
the target's MLPs and norms are compiled on a GPU as training compiles them. A last row times
them through the fast decoder's layer functions (`--target-forward decoder`: stacked q/k/v and
gate/up projections, its RoPE, compiled for every shape on a GPU), with the largest difference of
their features from HF's (relative to the largest feature).

With --shard (a prepared training shard, <run>/data/train) the micro-batches are the ones the
sampler draws from it, rows of mixed lengths, each collated, copied and run as training runs it
(compute_features) once for every --length-groups value (default 1 and 4), then with the rows
packed (`--target-forward packed`: real tokens only, in one forward): ms a micro-batch, real tokens/s,
the share of the positions computed that are real, and for the packed rows the largest difference of
their features from the padded forward's (relative to the largest feature).
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch.nn.attention import SDPBackend

from dflash.config import DEFAULT_BUCKETS
from dflash.data.chat_formats import DataError
from dflash.data.dataset import TokenDataset, collate
from dflash.data.sampler import RankAwareBucketSampler
from dflash.placement.features import compute_features
from dflash.target.frozen import SHAPE_FREE_SDPA, FrozenTarget, default_target_layer_ids, load_target_config
from dflash.target.gguf import resolve_target
from dflash.target.length_groups import computed_positions, plan_length_groups
from dflash.target.layer_features import layer_forward_problem, use_decoder_layers
from dflash.target.packed import packed_forward_problem, use_packed_rows
from dflash.util.cli import ConfigError, cli_parser, user_error
from dflash.util.runtime import pick_device, setup_logging, synchronize

logger = logging.getLogger(__name__)

BACKENDS = {"flash, efficient, math (training's)": SHAPE_FREE_SDPA,
            "cuDNN first where it applies": [SDPBackend.CUDNN_ATTENTION, *SHAPE_FREE_SDPA]}
DECODER_LAYERS = "the fast decoder's layers (--target-forward decoder)"
PACKED_ROWS = "packed rows (--target-forward packed)"


@dataclass
class TargetForwardArgs:
    target: str = field(metadata={"help": "HF causal-LM folder or .gguf file"})
    max_tokens: int = field(default=32768, metadata={"help": "rows x length of a micro-batch, at most"})
    min_length: int = 128
    max_length: int = 2048
    steps: int = field(default=30, metadata={"help": "timed micro-batches per backend set"})
    warmup: int = field(default=3, metadata={"help": "untimed micro-batches first (compilation)"})
    seed: int = 0
    device: str = "auto"
    dtype: str = "bfloat16"
    shard: str | None = field(default=None, metadata={"help": "a prepared training shard (<run>/data/train): its "
                                                               "sampler's micro-batches instead of random shapes"})
    length_groups: list[int] = field(default_factory=lambda: [1, 4], metadata={
        "help": "with --shard: the --target-length-groups values compared on the same micro-batches"})


def shapes(args: TargetForwardArgs, seed: int) -> list[tuple[int, int]]:
    """(rows, length) of each micro-batch."""
    draw = random.Random(seed)
    lengths = [draw.randint(args.min_length, args.max_length) for _ in range(args.warmup + args.steps)]
    return [(max(1, args.max_tokens // length), length) for length in lengths]


@torch.no_grad()
def time_forwards(target: FrozenTarget, batches: list[tuple[int, int]], warmup: int) -> dict:
    """Median ms a forward and tokens/s over batches[warmup:], each timed alone."""
    vocab, device = target.embed_tokens.weight.shape[0], target.device
    seconds, tokens = [], 0
    for n, (rows, length) in enumerate(batches):
        ids = torch.randint(0, vocab, (rows, length), device=device)
        synchronize(device)
        start = time.perf_counter()
        target.features(ids)
        synchronize(device)
        if n >= warmup:
            seconds.append(time.perf_counter() - start)
            tokens += rows * length
    return {"ms_per_forward_median": round(1e3 * statistics.median(seconds), 3),
            "tokens_per_second": round(tokens / sum(seconds)), "forwards": len(seconds)}


@torch.no_grad()
def largest_difference(target: FrozenTarget, batch: tuple[int, int]) -> float:
    """How far one random micro-batch's features through the decoder's layers (target.layer_forward)
    are from HF's, over the largest feature (HF's RMSNorm computes in float32 whatever the dtype)."""
    rows, length = batch
    ids = torch.randint(0, target.embed_tokens.weight.shape[0], (rows, length), device=target.device)
    ours = target.features(ids).features.float()
    layer_forward, target.layer_forward = target.layer_forward, None
    try:
        reference = target.features(ids).features.float()
    finally:
        target.layer_forward = layer_forward
    return float((ours - reference).abs().max() / reference.abs().max())


@torch.no_grad()
def time_shard_batches(target: FrozenTarget, dataset: TokenDataset, batches: list[list[int]], groups: int,
                       warmup: int) -> dict:
    """Median ms a micro-batch (collation, copies and the target, as training runs them) and real
    tokens/s over batches[warmup:], the target run in up to `groups` groups of rows."""
    seconds, real, computed = [], 0, 0
    packed = target.packed_forward is not None  # then only the real tokens are computed
    for n, indices in enumerate(batches):
        synchronize(target.device)
        start = time.perf_counter()
        compute_features(target, dataset, indices, 0, with_final_hidden=False, length_groups=groups)
        synchronize(target.device)
        if n >= warmup:
            seconds.append(time.perf_counter() - start)
            lengths = dataset.lengths[indices]
            real += int(lengths.sum())
            computed += int(lengths.sum()) if packed else computed_positions(plan_length_groups(lengths, groups))
    return {"ms_per_micro_batch_median": round(1e3 * statistics.median(seconds), 3),
            "real_tokens_per_second": round(real / sum(seconds)), "real_share_of_computed": round(real / computed, 4),
            "micro_batches": len(seconds)}


@torch.no_grad()
def packed_difference(target: FrozenTarget, dataset: TokenDataset, indices: list[int]) -> float:
    """How far a micro-batch's features with its rows packed are from the padded forward's, at
    the real positions, over the largest feature."""
    batch = collate(dataset, indices, 0)
    ids, lengths = batch["input_ids"].to(target.device), batch["lengths"]
    packed = target.features(ids, lengths=lengths).features.float()
    reference = target.features(ids).features.float()
    real = (torch.arange(ids.shape[1]) < lengths[:, None]).to(target.device)
    return float((packed - reference)[real].abs().max() / reference[real].abs().max())


def shard_batches(args: TargetForwardArgs, dataset: TokenDataset) -> list[list[int]]:
    """The sampler's first micro-batches of epoch 0, as a one-rank run at --max-tokens draws them."""
    sampler = RankAwareBucketSampler(dataset.lengths, DEFAULT_BUCKETS, args.max_tokens, num_replicas=1,
                                     seed=args.seed)
    sampler.set_epoch(0)
    batches = [indices for _, indices in sampler.rank_batches(0)][:args.warmup + args.steps]
    if len(batches) < args.warmup + args.steps:
        raise ConfigError(f"--shard {args.shard}: {len(batches)} micro-batches of --max-tokens {args.max_tokens}, "
                          f"fewer than --warmup + --steps = {args.warmup + args.steps}")
    return batches


def main(argv: list[str] | None = None) -> dict:
    (args,) = cli_parser(TargetForwardArgs).parse_args_into_dataclasses(argv)
    setup_logging(0)
    try:  # before the target loads: a wrong --shard ends the command at once
        dataset = TokenDataset(args.shard) if args.shard else None
        batches = shard_batches(args, dataset) if dataset is not None else []
    except (DataError, ConfigError) as err:
        raise SystemExit(user_error(err)) from err
    device = pick_device(args.device, 0)
    folder = resolve_target(args.target)
    layers = default_target_layer_ids(load_target_config(folder).num_hidden_layers, 5)
    target = FrozenTarget.load(folder, layers, getattr(torch, args.dtype), device)
    if device.type == "cuda":
        target.compile_pointwise()
    results = {"target": args.target, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
               else "cpu", "dtype": args.dtype, "max_tokens": args.max_tokens}
    if dataset is not None:
        for groups in args.length_groups:
            results[f"length groups {groups}"] = time_shard_batches(target, dataset, batches, groups, args.warmup)
            logger.info("length groups %d: %s", groups, results[f"length groups {groups}"])
        if packed_forward_problem(target) is None:  # what --target-forward packed trains with
            use_packed_rows(target)
            results[PACKED_ROWS] = {**time_shard_batches(target, dataset, batches, 1, args.warmup),
                                    "largest_difference_over_largest_feature":
                                        packed_difference(target, dataset, batches[0])}
            logger.info("%s: %s", PACKED_ROWS, results[PACKED_ROWS])
    else:
        for n, (name, backends) in enumerate(BACKENDS.items()):
            target.attention_backends = backends
            results[name] = time_forwards(target, shapes(args, args.seed + n), args.warmup)
            logger.info("%s: %s", name, results[name])
        if layer_forward_problem(target) is None:  # what --target-forward decoder trains with
            target.attention_backends = SHAPE_FREE_SDPA
            use_decoder_layers(target, compiled=device.type == "cuda")
            batches = shapes(args, args.seed + len(BACKENDS))
            results[DECODER_LAYERS] = {**time_forwards(target, batches, args.warmup),
                                       "largest_difference_over_largest_feature": largest_difference(target, batches[0])}
            logger.info("%s: %s", DECODER_LAYERS, results[DECODER_LAYERS])
    print(json.dumps(results), flush=True)
    return results


if __name__ == "__main__":
    main()
