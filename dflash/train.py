"""The training run: config -> ranks -> data -> target -> drafter engine -> steps -> export -> eval.

Colocated placement: every rank holds the frozen target and a drafter replica; DeepSpeed
data-parallelises the drafter (ZeRO shards its optimizer state).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dflash.attention import resolve_backend
from dflash.config import REPO_ROOT, ConfigError, RunConfig
from dflash.data import LengthBucketBatcher, TokenDataset, collate, load_tokenizer, prepare_dataset
from dflash.distributed import RankInfo
from dflash.drafter_step import DrafterStep, StepSettings
from dflash.export import export_drafter
from dflash.metrics import MetricsLogger, WindowMetrics, progress_line
from dflash.model import DFlashDrafter, drafter_config
from dflash.objective import default_gamma, feature_noise_std, slot_weights
from dflash.target import (
    FrozenTarget,
    check_target_layer_ids,
    default_target_layer_ids,
    load_target_config,
    resolve_mask_token_id,
)

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    steps: int
    seconds: float
    drafter_dir: Path
    initial_drafter_dir: Path
    last_metrics: dict


def deepspeed_config(config: RunConfig, device: torch.device) -> dict:
    """The JSON file with our flags filled in where it says "auto"."""
    path = config.train.deepspeed_config
    if path is None:
        path = REPO_ROOT / "ds_configs" / ("zero1.json" if device.type == "cuda" else "cpu.json")
    try:
        ds = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--deepspeed-config {path}: cannot read it as JSON ({err})") from err
    autos = {
        "gradient_accumulation_steps": config.train.grad_accum,
        "gradient_clipping": config.train.grad_clip,
    }
    for key, value in autos.items():
        if ds.get(key, "auto") == "auto":
            ds[key] = value
    bf16 = ds.setdefault("bf16", {})
    if bf16.get("enabled", "auto") == "auto":
        bf16["enabled"] = device.type == "cuda"
    return ds


def lr_lambda(total_steps: int, warmup_ratio: float):
    """Linear warmup over warmup_ratio of the steps, then cosine decay to 0."""
    warmup = max(1, int(round(total_steps * warmup_ratio)))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def anchor_generator(seed: int, epoch: int, batch_index: int) -> torch.Generator:
    """Anchors are re-sampled every epoch and reproducible from (seed, epoch, batch)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 1_000_003 + batch_index)


def rank_batches(batcher: LengthBucketBatcher, ranks: RankInfo, per_rank: int) -> list[list[int]]:
    """This rank's share of the epoch's micro-batches: every world_size-th one, the same count
    on every rank so data-parallel steps stay in lockstep."""
    return list(batcher)[ranks.rank::ranks.world_size][:per_rank]


def build_drafter_config(config: RunConfig, tokenizer):
    target_config = load_target_config(config.model.target)
    num_layers = target_config.num_hidden_layers
    layer_ids = config.model.target_layer_ids or default_target_layer_ids(num_layers, config.model.num_target_features)
    check_target_layer_ids(layer_ids, num_layers)
    mask_id = resolve_mask_token_id(tokenizer, target_config, config.model.mask_token_id)
    return drafter_config(target_config, config.model.num_draft_layers, layer_ids, config.model.block_size, mask_id)


def prepare_data(config: RunConfig, tokenizer, ranks: RankInfo) -> TokenDataset:
    """Rank 0 tokenizes (or reuses the cached shard); the others wait and open it."""
    shard = Path(config.train.output_dir) / "data" / "train"
    if ranks.is_main:
        prepare_dataset(config.data.train_data, tokenizer, shard, config.data.max_length, config.data.overflow)
    if dist.is_initialized():
        dist.barrier()
    return TokenDataset(shard)


def train(config: RunConfig, ranks: RankInfo) -> TrainResult:
    import deepspeed

    out_dir = Path(config.train.output_dir)
    device = ranks.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(config.train.seed)

    tokenizer = load_tokenizer(config.model.tokenizer)
    dcfg = build_drafter_config(config, tokenizer)
    dataset = prepare_data(config, tokenizer, ranks)
    batcher = LengthBucketBatcher(
        dataset.lengths, config.data.bucket_boundaries, config.data.max_tokens, seed=config.train.seed
    )
    batches_per_rank = len(batcher) // ranks.world_size
    if batches_per_rank == 0:
        raise ConfigError(
            f"{len(batcher)} micro-batches per epoch cannot feed {ranks.world_size} ranks; "
            "lower --max-tokens or add data"
        )
    steps_per_epoch = math.ceil(batches_per_rank / config.train.grad_accum)
    total_steps = steps_per_epoch * config.train.epochs
    if config.train.max_steps > 0:
        total_steps = min(total_steps, config.train.max_steps)

    target = FrozenTarget.load(config.model.target, dcfg.dflash_config["target_layer_ids"], dtype, device)
    drafter = DFlashDrafter(dcfg)
    initial_dir = export_drafter(drafter, out_dir / "drafter-init") if ranks.is_main else out_dir / "drafter-init"
    optimizer = torch.optim.AdamW(
        drafter.parameters(), lr=config.train.lr, betas=(0.9, 0.95), weight_decay=config.train.weight_decay,
        fused=device.type == "cuda",
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total_steps, config.train.warmup_ratio))
    engine, _, _, _ = deepspeed.initialize(
        model=drafter, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(config, device)
    )
    gamma = config.train.gamma or default_gamma(dcfg.block_size)
    settings = StepSettings(
        max_anchors=config.train.max_anchors,
        slot_weights=slot_weights(dcfg.block_size, gamma),
        attention_backend=resolve_backend(config.model.attention_backend, device),
        kl_weight=config.train.kl_weight,
    )
    step = DrafterStep(engine.module, target.embed_tokens, target.lm_head, settings, forward=engine)
    logger.info(
        "target %s: %d layers, features from %s | drafter %d layers, %.1fM trainable params | B=%d A=%d gamma=%g | "
        "%d sequences, %d micro-batches/epoch, %d steps, attention %s, %s",
        config.model.target, dcfg.num_target_layers, dcfg.dflash_config["target_layer_ids"], dcfg.num_hidden_layers,
        sum(p.numel() for p in drafter.parameters()) / 1e6, dcfg.block_size, config.train.max_anchors, gamma,
        len(dataset), len(batcher), total_steps, settings.attention_backend, dtype,
    )

    metrics = MetricsLogger(
        out_dir, config.train.report_to, config.train.wandb_mode, _flat_config(config), enabled=ranks.is_main
    )
    window = WindowMetrics(dcfg.block_size)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    started = time.perf_counter()
    last: dict = {}
    done = False
    for epoch in range(config.train.epochs):
        batcher.set_epoch(epoch)
        for batch_index, indices in enumerate(rank_batches(batcher, ranks, batches_per_rank)):
            batch = {k: v.to(device) for k, v in collate(dataset, indices, pad_id).items()}
            target_out = target.features(batch["input_ids"], with_final_hidden=config.train.kl_weight > 0)
            blocks = step.sample_blocks(
                batch["input_ids"], batch["loss_mask"], anchor_generator(config.train.seed, epoch, batch_index * ranks.world_size + ranks.rank)
            )
            noise = feature_noise_std(engine.global_steps, total_steps, config.train.feature_noise_std)
            out = step.loss(blocks, target_out, noise_std=noise)
            engine.backward(out.loss)
            engine.step()
            window.add(out, tokens=int(batch["lengths"].sum()))
            at_boundary = (batch_index + 1) % config.train.grad_accum == 0
            if at_boundary and (engine.global_steps % config.train.log_every == 0 or engine.global_steps >= total_steps):
                last = window.summary()
                last.update(
                    step=engine.global_steps, epoch=epoch, epochs=config.train.epochs,
                    epoch_fraction=(batch_index + 1) / batches_per_rank, lr=scheduler.get_last_lr()[0],
                    noise_std=noise, elapsed_s=time.perf_counter() - started,
                )
                metrics.log(last)
                logger.info(progress_line(last, total_steps))
                window.reset()
            if engine.global_steps >= total_steps:
                done = True
                break
        if done:
            break
    seconds = time.perf_counter() - started
    drafter_dir = out_dir / "drafter"
    if ranks.is_main:
        export_drafter(engine.module, drafter_dir)
        logger.info("trained %d steps in %.1f s; drafter exported to %s", engine.global_steps, seconds, drafter_dir)
    metrics.close()
    return TrainResult(engine.global_steps, seconds, drafter_dir, initial_dir, last)


def _flat_config(config: RunConfig) -> dict:
    return {**dataclasses.asdict(config.model), **dataclasses.asdict(config.data), **dataclasses.asdict(config.train)}
