"""Train the embedded demo target: a tokenizer and a tiny Qwen3 model, from scratch, --epochs
passes over chat conversations (dflash/demo/chat_corpus.py; the demo's are edit_tasks.py's). The
target's loss on held-out conversations and on as many training ones is written beside it
(build_report.json). Everything is seeded: a rerun on the same software stack reproduces the
weights.

    python -m dflash.demo.build_target --chats chats.jsonl --epochs 3
    python -m dflash.demo.build_target --chats chats.jsonl --device cuda --batch-size 64
"""

import argparse
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
from dflash.demo.chat_corpus import (conversation_texts, encode_all, load_conversations, mean_loss, one_pass,
                                     padded_batches)
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
# ChatML as used by Qwen. Every message ends in "<|im_end|>\n" and the generation
# prompt is exactly the header of the next assistant message, so rendering
# messages[:i] with a generation prompt is a prefix of rendering messages[:i + 1].
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Loss is reported as the mean over this many steps (also the start/end loss).
LOG_EVERY = 25
# The checkpoint is written in shards of at most this size, so that no tracked file is large.
SHARD_SIZE = "4MB"
# Written next to the target: its losses, read by the demo quality test.
BUILD_REPORT = "build_report.json"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chats", type=Path, nargs="+", required=True, help="chat JSONL files to train on")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the conversations")
    parser.add_argument("--output-dir", type=Path, default=DEMO_TARGET_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=4096, help="tokenizer size incl. special tokens")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=12,
                        help="depth: a deeper target makes a greedy step cost more next to the drafter's")
    parser.add_argument("--intermediate-size", type=int, default=512, help="MLP width (checkpoint size grows with it)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="auto", help="auto (cuda when there is one) | cpu | cuda")
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
    """Tiny Qwen3 (defaults: 8.2M parameters, a bf16 checkpoint of 16 MB).

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


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def train(model: Qwen3ForCausalLM, data: Iterator[tuple[torch.Tensor, ...]], steps: int,
          args: argparse.Namespace) -> dict[str, float | int]:
    """AdamW in fp32 (bf16 autocast on a GPU), one batch of `data` per step."""
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    losses: list[float] = []
    start = time.monotonic()
    for step in range(steps):
        lr = args.lr * lr_factor(step, args.warmup_steps, steps)
        set_lr(optimizer, lr)
        input_ids, attention_mask, labels = (t.to(device) for t in next(data))
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % LOG_EVERY == 0:
            logger.info("step %d/%d loss %.3f lr %.2e", step + 1, steps, mean(losses[-LOG_EVERY:]), lr)
    return {
        "steps": steps,
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
    if args.hidden_size < 64 or args.hidden_size % 64:
        raise SystemExit(f"--hidden-size {args.hidden_size}: use a multiple of 64 (attention heads are 64 wide)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train_chats, heldout_chats = load_conversations(args.chats)
    logger.info("training on %d conversations (%d held out)", len(train_chats), len(heldout_chats))
    tokenizer = train_tokenizer(conversation_texts(train_chats), args.vocab_size)
    config = build_config(tokenizer, args)
    logger.info("tokenizer has %d tokens; model vocab_size %d", len(tokenizer), config.vocab_size)
    model = Qwen3ForCausalLM(config).to(pick_device(args.device, 0))
    logger.info("model has %.2fM parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    stats = train_on_chats(model, tokenizer, train_chats, heldout_chats, args)
    save(model, tokenizer, args.output_dir)
    summary = {"seed": args.seed, "len_tokenizer": len(tokenizer), "vocab_size": config.vocab_size, **stats}
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
    logger.info("%d training samples, %d tokens: %d steps (%d conversations left out: no reply within "
                "--max-length %d)", len(train_samples), sum(len(ids) for ids, _ in train_samples), len(groups),
                len(train_chats) - len(train_samples), args.max_length)
    stats = train(model, padded_batches(train_samples, groups, pad), len(groups), args)
    model.eval()
    seen = random.Random(args.seed).sample(train_samples, min(len(train_samples), len(heldout_samples)))
    stats["train_loss"] = round(mean_loss(model, seen, args.batch_size, pad), 4)
    stats["heldout_loss"] = round(mean_loss(model, heldout_samples, args.batch_size, pad), 4)
    stats["train_tokens"] = sum(len(ids) for ids, _ in train_samples) * args.epochs
    return stats


if __name__ == "__main__":
    main()
