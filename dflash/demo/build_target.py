"""Train the embedded demo target: a tokenizer and a tiny Qwen3 model, from scratch.

With --chats, the corpus is chat conversations (dflash/demo/chat_corpus.py), seen once, and the
target's loss on held-out conversations is written beside it (build_report.json); without, it is
the Python standard library (dflash/demo/corpus.py).

The target only has to be good enough that its greedy continuations of Python code
are plausible and fairly predictable, which is what gives a drafter something to
learn. Everything is seeded; given ``--seed`` and ``--steps`` a rerun on the same
software stack reproduces the weights. ``--minutes`` instead picks the number of
steps from the measured speed of the first steps, and logs it so that the run can be
repeated exactly with ``--steps``.

    python -m dflash.demo.build_target --minutes 12
    python -m dflash.demo.build_target --device cuda --batch-size 64 --workers 12 --steps 20000
    python -m dflash.demo.build_target --device cuda --chats runs/real/data/regen.jsonl --batch-size 64
"""

import argparse
import itertools
import json
import logging
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path
from statistics import mean

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from dflash.demo import DEMO_TARGET_DIR
from dflash.demo.chat_corpus import (collate, conversation_texts, encode_all, first_turns, load_conversations,
                                     mean_loss, one_pass, padded_batches)
from dflash.demo.corpus import (CHAT_TEMPLATE, PROMPT_LINES, RESPONSE_LINES, SnippetSampler, SourceFile, load_sources,
                                user_prompt)
from dflash.util.runtime import pick_device

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2/3 pre-tokenization: digits split one by one and newlines end a pre-token,
# so "assistant\n" tokenizes the same whether or not content follows it. That keeps
# the chat template prefix-stable at the token level, not just as text.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# --minutes times the second half of the warmup (the first half holds start-up: worker
# processes filling their first pools, kernel warm-up) and fixes the step budget when the
# warmup ends; the warmup's schedule does not depend on the total, so a --minutes run
# equals a --steps run.
# Samples drawn at once and sorted by length so that batches need little padding.
BUCKET_BATCHES = 8
# Loss is reported as the mean over this many steps (also the start/end loss).
LOG_EVERY = 25
# The checkpoint is written in shards of at most this size, so that no tracked file is large.
SHARD_SIZE = "8MB"
# Written next to a target built from chats: its losses, read by the demo quality test.
BUILD_REPORT = "build_report.json"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=DEMO_TARGET_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=12.0, help="wall-clock training budget")
    parser.add_argument("--steps", type=int, default=None, help="exact step count; overrides --minutes")
    parser.add_argument("--vocab-size", type=int, default=2048, help="tokenizer size incl. special tokens")
    parser.add_argument("--intermediate-size", type=int, default=256, help="MLP width (checkpoint size grows with it)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="auto", help="auto (cuda when there is one) | cpu | cuda")
    parser.add_argument("--workers", type=int, default=0,
                        help="processes making batches (0: in the training process; a GPU outruns one)")
    parser.add_argument("--chats", type=Path, nargs="+", help="chat JSONL files: train on their conversations instead")
    parser.add_argument("--epochs", type=int, default=1, help="--chats: passes over the conversations")
    parser.add_argument("--max-conversations", type=int, default=0, help="--chats: the first N that pass the filters (0: all)")
    parser.add_argument("--max-prompt-chars", type=int, default=0,
                        help="--chats: leave out conversations whose first turn is longer (0: keep all)")
    parser.add_argument("--exclude-prompts", type=Path, action="append", default=[],
                        help="--chats: leave out conversations that start with a prompt of this file (the demo's "
                             "held-out prompts; repeatable)")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    return parser.parse_args()


def train_tokenizer(texts: Iterator[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE over the training texts, wrapped with the ChatML template."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        padding_side="left",
    )


def build_config(tokenizer: PreTrainedTokenizerFast, args: argparse.Namespace) -> Qwen3Config:
    """Tiny Qwen3 (defaults: a bf16 checkpoint around 14 MB).

    The vocab is padded to a multiple of 64 and always past len(tokenizer), leaving
    embedding rows the target never emits (the drafter's mask token lives there).
    """
    vocab_size = (len(tokenizer) // 64 + 1) * 64
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden_size // 64,
        num_key_value_heads=max(1, args.hidden_size // 128),
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def encode_sample(
    tokenizer: PreTrainedTokenizerFast, code: str, answer: str, max_length: int
) -> tuple[list[int], list[int]]:
    """Token ids and labels; only the answer and its closing <|im_end|> are supervised."""
    user = {"role": "user", "content": user_prompt(code)}
    prompt = tokenizer.apply_chat_template([user], add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template([user, {"role": "assistant", "content": answer}], tokenize=False)
    # The raw tokenizer skips the wrapper's warning about texts longer than the model
    # context; samples are cut to max_length below anyway.
    prompt_ids = tokenizer.backend_tokenizer.encode(prompt).ids
    ids = tokenizer.backend_tokenizer.encode(full).ids
    if ids[: len(prompt_ids)] != prompt_ids:
        raise ValueError("chat template is not prefix-stable for this sample")
    # Drop the newline after the final <|im_end|>: generation stops before it.
    ids = ids[:-1]
    labels = [-100] * len(prompt_ids) + ids[len(prompt_ids) :]
    return ids[:max_length], labels[:max_length]


def batches(
    sampler: SnippetSampler, tokenizer: PreTrainedTokenizerFast, batch_size: int, max_length: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Endless padded batches, bucketed by length; the order depends only on the seed."""
    rng = random.Random(seed + 1)
    while True:
        pool = [
            encode_sample(tokenizer, *sampler.sample(PROMPT_LINES, RESPONSE_LINES), max_length)
            for _ in range(batch_size * BUCKET_BATCHES)
        ]
        pool.sort(key=lambda pair: len(pair[0]))
        groups = [pool[i : i + batch_size] for i in range(0, len(pool), batch_size)]
        rng.shuffle(groups)
        for group in groups:
            yield collate(group, tokenizer.pad_token_id)


class BatchStream(torch.utils.data.IterableDataset):
    """`batches` in worker processes: worker w draws with seed + 1000 w, and the loader takes
    one batch from each worker in turn, so a run is reproducible for a given --workers (0: the
    training process itself, with the seed as given)."""

    def __init__(self, sources: list[SourceFile], tokenizer, batch_size: int, max_length: int, seed: int):
        super().__init__()
        self.sources, self.tokenizer = sources, tokenizer
        self.batch_size, self.max_length, self.seed = batch_size, max_length, seed

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        seed = self.seed + 1000 * (info.id if info is not None else 0)
        yield from batches(SnippetSampler(self.sources, seed), self.tokenizer, self.batch_size, self.max_length, seed)


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def train(
    model: Qwen3ForCausalLM, data: Iterator[tuple[torch.Tensor, ...]], args: argparse.Namespace
) -> dict[str, float | int]:
    """AdamW in fp32 for --steps, or for as many steps as fit into --minutes."""
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total_steps = args.steps or 10**9
    losses: list[float] = []
    start = time.monotonic()
    for step in itertools.count():
        if step == total_steps:
            break
        if step == args.warmup_steps // 2:
            timed_from = time.monotonic()
        if args.steps is None and step == args.warmup_steps:
            per_step = (time.monotonic() - timed_from) / (args.warmup_steps - args.warmup_steps // 2)
            total_steps = max(args.warmup_steps + 1, int(args.minutes * 60 / per_step))
            logger.info(
                "%.2fs per step: training for %d steps (repeat with --steps %d)",
                per_step, total_steps, total_steps
            )
        lr = args.lr * lr_factor(step, args.warmup_steps, total_steps)
        set_lr(optimizer, lr)
        input_ids, attention_mask, labels = (t.to(device) for t in next(data))
        # bf16 autocast on a GPU (fp32 master weights); the CPU path stays in fp32.
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % LOG_EVERY == 0:
            logger.info("step %d/%d loss %.3f lr %.2e", step + 1, total_steps, mean(losses[-LOG_EVERY:]), lr)
    return {
        "steps": total_steps,
        "loss_start": mean(losses[:LOG_EVERY]),
        "loss_end": mean(losses[-LOG_EVERY:]),
        "minutes": round((time.monotonic() - start) / 60, 2),
    }


def save(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, output_dir: Path) -> None:
    """Write a bf16 checkpoint that loads with the Auto* classes, plus greedy defaults."""
    output_dir.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model.save_pretrained(output_dir, max_shard_size=SHARD_SIZE)
    tokenizer.save_pretrained(output_dir)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args()
    if args.warmup_steps < 2:
        raise SystemExit(f"--warmup-steps {args.warmup_steps}: at least 2 (--minutes times the warmup's second half)")
    if args.chats and args.steps is not None:
        raise SystemExit(f"--steps {args.steps}: with --chats the run is --epochs whole passes over the conversations; "
                         "leave --steps out")
    if args.hidden_size < 64 or args.hidden_size % 64:
        raise SystemExit(f"--hidden-size {args.hidden_size}: use a multiple of 64 (attention heads are 64 wide)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.chats:
        excluded = set().union(*(first_turns(path) for path in args.exclude_prompts))
        train_chats, heldout_chats = load_conversations(args.chats, excluded, args.max_prompt_chars,
                                                        args.max_conversations)
        logger.info("training on %d conversations (%d held out)", len(train_chats), len(heldout_chats))
        tokenizer = train_tokenizer(conversation_texts(train_chats), args.vocab_size)
    else:
        sources = load_sources(heldout=False)
        logger.info("training on %d stdlib files (%d lines)", len(sources), sum(len(s.lines) for s in sources))
        tokenizer = train_tokenizer(("\n".join(source.lines) for source in sources), args.vocab_size)
    config = build_config(tokenizer, args)
    logger.info("tokenizer has %d tokens; model vocab_size %d", len(tokenizer), config.vocab_size)
    model = Qwen3ForCausalLM(config).to(pick_device(args.device, 0))
    logger.info("model has %.2fM parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    if args.chats:
        stats = train_on_chats(model, tokenizer, train_chats, heldout_chats, args)
    else:
        stream = BatchStream(sources, tokenizer, args.batch_size, args.max_length, args.seed)
        loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=args.workers,
                                             prefetch_factor=8 if args.workers else None)
        stats = train(model, iter(loader), args)
    save(model, tokenizer, args.output_dir)
    summary = {"seed": args.seed, "len_tokenizer": len(tokenizer), "vocab_size": config.vocab_size, **stats}
    if args.chats:
        (args.output_dir / BUILD_REPORT).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


def train_on_chats(model: Qwen3ForCausalLM, tokenizer, train_chats: list, heldout_chats: list,
                   args: argparse.Namespace) -> dict:
    """--epochs passes over the training conversations, then the loss per supervised token on the
    held-out ones and on as many training ones: a target that follows its prompt scores about the
    same on both (the demo quality test holds it to HELDOUT_LOSS_RATIO)."""
    train_samples = encode_all(tokenizer, train_chats, args.max_length)
    heldout_samples = encode_all(tokenizer, heldout_chats, args.max_length)
    pad = tokenizer.pad_token_id
    lengths = [len(ids) for ids, _ in train_samples]
    groups = [g for epoch in range(args.epochs) for g in one_pass(lengths, args.batch_size, args.seed + epoch)]
    args.steps = len(groups)
    logger.info("%d training samples, %d tokens: %d steps (%d conversations left out: no reply within "
                "--max-length %d)", len(train_samples), sum(len(ids) for ids, _ in train_samples), args.steps,
                len(train_chats) - len(train_samples), args.max_length)
    stats = train(model, padded_batches(train_samples, groups, pad), args)
    model.eval()
    seen = random.Random(args.seed).sample(train_samples, min(len(train_samples), len(heldout_samples)))
    stats["train_loss"] = round(mean_loss(model, seen, args.batch_size, pad), 4)
    stats["heldout_loss"] = round(mean_loss(model, heldout_samples, args.batch_size, pad), 4)
    stats["train_tokens"] = sum(len(ids) for ids, _ in train_samples) * args.epochs
    return stats

if __name__ == "__main__":
    main()
