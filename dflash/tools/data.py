"""Data tools run ahead of a launch, with the same flags as train_drafter.py:

    python -m dflash.tools.data prepare --target /models/Qwen3-8B --train-data chats.jsonl --output-dir runs/x
    python -m dflash.tools.data stats   --target /models/Qwen3-8B --train-data chats.jsonl --output-dir runs/x

`prepare` tokenizes into <output-dir>/data/train, the shard the run with those flags then reuses
(so a long preparation does not hold the launched ranks), and de-quantizes a GGUF --target into
<output-dir>/target-hf for the same reason. `stats` tokenizes too (it needs no target weights), then
reports the length histogram against the buckets, the loss-token share, what was truncated or skipped,
anchors per sequence, the share of trained tokens inside repetition loops, how much of the replies a
--draft-vocab holds, and the steps per epoch for 1 and 8 drafter ranks.
"""

from __future__ import annotations

import sys

import numpy as np

from dflash.config import RunConfig, parse_config
from dflash.data.chat_formats import DataError
from dflash.data.dataset import TokenDataset
from dflash.data.sampler import RankAwareBucketSampler
from dflash.data.thinking import resolve_thinking
from dflash.data.tokenization import load_tokenizer
from dflash.data.tokenizer_match import check_tokenizer_matches_target
from dflash.drafter.vocab import choose_draft_vocabulary
from dflash.target.frozen import TargetError
from dflash.target.gguf import resolve_target, run_target_dir
from dflash.target.length_groups import computed_positions, plan_length_groups
from dflash.training.shard import prepare_train_shard
from dflash.util.cli import ConfigError, user_error
from dflash.util.runtime import setup_logging


COMMANDS = ("prepare", "stats")
LOOP_NGRAM = 8  # a trained token is in a loop when the n-gram it ends already occurred in its reply
LOOP_OPENING = 128  # ... and the share is reported again over each reply's first tokens


def repeated_ngram_share(samples, n: int = LOOP_NGRAM, opening: int = LOOP_OPENING) -> tuple[float, float]:
    """Of the trained tokens of (ids, loss mask) samples, the share whose n-gram (the n trained
    tokens ending at it) occurred earlier among the sample's trained tokens: repetition loops,
    which greedy replies of small targets fall into and which are easy to draft, so that training
    accuracy runs above held-out acceptance. Again over the first `opening` trained tokens."""
    looped = total = looped_opening = total_opening = 0
    powers = np.uint64(1_000_003) ** np.arange(n, dtype=np.uint64)  # wraps mod 2^64: a hash
    for ids, mask in samples:
        reply = ids[mask].astype(np.uint64)
        total += len(reply)
        total_opening += min(len(reply), opening)
        if len(reply) < n:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(reply, n)
        _, first, inverse = np.unique(windows @ powers, return_index=True, return_inverse=True)
        repeats = first[inverse] < np.arange(len(windows))  # window i ends at token i + n - 1
        looped += int(repeats.sum())
        looped_opening += int(repeats[: max(0, opening - n + 1)].sum())
    return looped / max(total, 1), looped_opening / max(total_opening, 1)


def draft_vocab_shares(samples, vocab_size: int, size: int, always=(), fold: int = 10,
                       opening: int = LOOP_OPENING) -> tuple[float, float]:
    """The share of reply tokens that a draft vocabulary of `size` holds in replies it was not
    chosen on: chosen as training chooses it, on the trained tokens of every (ids, loss mask)
    sample but each fold-th, and measured on those, over whole replies and over each reply's first
    `opening`. A reply token outside it ends a streak, and decoding meets only such unseen
    replies, so this share, not the one in the replies counted, bounds acceptance."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    unseen = []
    for i, (ids, mask) in enumerate(samples):
        reply = ids[mask]
        if i % fold == fold - 1:
            unseen.append(reply)
        else:
            counts += np.bincount(reply, minlength=vocab_size)[:vocab_size]
    held = np.zeros(vocab_size, dtype=bool)
    held[choose_draft_vocabulary(counts, size, always).numpy()] = True
    whole = np.concatenate(unseen) if unseen else np.zeros(0, dtype=np.int64)
    first = np.concatenate([r[:opening] for r in unseen]) if unseen else whole
    return float(held[whole].mean()) if len(whole) else 1.0, float(held[first].mean()) if len(first) else 1.0


def stats_report(config: RunConfig, dataset: TokenDataset, vocab_size: int, eos_id: int | None) -> str:
    manifest = dataset.manifest
    counts = manifest["stats"]
    lengths = dataset.lengths
    bounds = config.data.bucket_boundaries
    bucket = np.clip(np.searchsorted(bounds, lengths, side="right") - 1, 0, len(bounds) - 1)
    anchors = np.minimum(dataset.anchor_candidates(), config.train.max_anchors)
    looped, looped_opening = repeated_ngram_share(dataset[i] for i in range(len(dataset)))
    lines = [
        f"{config.data.train_data}: {counts['samples_read']} samples read, {counts['samples_kept']} kept, "
        f"{counts['samples_truncated']} truncated and {counts['samples_dropped']} dropped at --max-length "
        f"{config.data.max_length}, {counts['samples_bad']} bad skipped {counts['bad_reasons'] or ''}".rstrip(),
        f"replies cut at the regeneration's length limit: {counts['samples_cut']} ({counts['samples_cut_dropped']} "
        f"dropped, --cut-replies {config.data.cut_replies}); thinking {manifest['thinking']}; "
        f"{counts['samples_split_by_turn']} conversations trained one sequence per assistant turn",
        f"tokens: {manifest['num_tokens']:,} in all, {counts['num_loss_tokens'] / max(manifest['num_tokens'], 1):.1%} "
        f"of them trained on (assistant tokens); length p10/p50/p90/max "
        f"{'/'.join(str(int(v)) for v in np.quantile(lengths, [0.1, 0.5, 0.9, 1.0]))}",
        f"anchors per sequence (at most --max-anchors {config.train.max_anchors}): mean {anchors.mean():.0f}, "
        f"{(anchors == config.train.max_anchors).mean():.0%} of sequences at the maximum",
        "trained tokens in repetition loops (their {}-gram occurred earlier in the reply): {:.1%}; "
        "in each reply's first {}: {:.1%}".format(LOOP_NGRAM, looped, LOOP_OPENING, looped_opening),
        "buckets (--bucket-boundaries): from length -> sequences, share of tokens",
    ]
    size = config.model.draft_vocab
    if size:
        whole, opening = draft_vocab_shares((dataset[i] for i in range(len(dataset))), vocab_size, size,
                                            [eos_id] if eos_id is not None else [])
        lines.insert(-1, f"--draft-vocab {size}: chosen on 9 in 10 samples, it holds {whole:.2%} of the 10th's "
                         f"reply tokens, {opening:.2%} of each reply's first {LOOP_OPENING} (a token outside it "
                         "ends a streak)")
    for b, start in enumerate(bounds):
        members = bucket == b
        lines.append(f"  {start:>6}: {int(members.sum()):>8} sequences, {lengths[members].sum() / lengths.sum():6.1%}")
    for ranks in (1, 8):
        sampler = RankAwareBucketSampler(lengths, bounds, config.data.max_tokens, num_replicas=ranks,
                                         seed=config.train.seed, echo=config.data.reuse_features,
                                         echo_span=config.train.grad_accum,
                                         group_by_length=config.data.group_by_length)
        steps = -(-sampler.steps_per_epoch() // config.train.grad_accum)
        lines.append(f"steps per epoch with {ranks} drafter rank(s), --max-tokens {config.data.max_tokens}: {steps} "
                     "(on a GPU the draft-position budget can cut micro-batches further)")
        if ranks == 1:
            batches = [sampler.step_batches(step)[0] for step in range(sampler.steps_per_epoch())]
            real = sum(int(lengths[b].sum()) for b in batches)
            padded = sum(len(b) * int(lengths[b].max()) for b in batches if b)
            groups = config.data.target_length_groups
            computed = sum(computed_positions(plan_length_groups(lengths[b], groups)) for b in batches if b)
            lines.append(f"real tokens among a micro-batch's padded ones: {real / padded:.1%} "
                         f"(--group-by-length {str(config.data.group_by_length).lower()}); among the positions the "
                         f"target computes in --target-length-groups {groups}: {real / computed:.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m dflash.tools.data {{{'|'.join(COMMANDS)}}} [train_drafter.py flags]", file=sys.stderr)
        return 2
    setup_logging(0)
    try:
        config = parse_config(argv[1:], for_training=False)
        tokenizer = load_tokenizer(config.model.tokenizer)
        check_tokenizer_matches_target(tokenizer, config.model.target, config.model.tokenizer,
                                       config.model.allow_tokenizer_mismatch)
        shard = prepare_train_shard(config, tokenizer, resolve_thinking(tokenizer, config.data.thinking))
        if argv[0] == "prepare":  # a GGUF target's conversion too, which the launched run then reuses
            resolve_target(config.model.target, run_target_dir(config.train.output_dir))
        if argv[0] == "stats":
            # the tokenizer's ids bound the replies' (the target's rows past them are never written)
            vocab_size = max(len(tokenizer), config.model.draft_vocab or 0)
            print(stats_report(config, TokenDataset(shard), vocab_size, tokenizer.eos_token_id))
    except (ConfigError, DataError, TargetError) as err:
        return user_error(err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
