"""Benchmark assets made locally (nothing is downloaded): a random-weight target with the shapes
of Qwen3-8B and chat data of realistic lengths, tokenized by the demo tokenizer.

    python -m dflash.benchmarks.assets --out runs/bench/assets            # 8B shapes, 600 samples
    python -m dflash.benchmarks.assets --out /tmp/a --num-layers 4 --samples 20   # a quick small one

The weights are random, so losses mean nothing; shapes, FLOPs, memory and transfer sizes are
those of the real model. Responses are lines of demo answers, about as many tokens as a length
drawn uniformly from [--min-tokens, --max-tokens].
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from dflash.demo import DEMO_TARGET_DIR, DEMO_TRAIN_DATA
from dflash.util.cli import cli_parser


@dataclass
class AssetArgs:
    out: str = "runs/bench/assets"
    num_layers: int = 36
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_heads: int = 32
    num_kv_heads: int = 8
    vocab_size: int = 151936
    samples: int = 600
    min_tokens: int = 300
    max_tokens: int = 2600
    seed: int = 0


def write_target(args: AssetArgs, folder: Path) -> None:
    config = Qwen3Config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
        head_dim=args.hidden_size // args.num_heads, max_position_embeddings=40960, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # random init of 8B params is slow on a CPU
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(DEMO_TARGET_DIR).save_pretrained(folder)


def write_chats(args: AssetArgs, path: Path) -> list[int]:
    """Chat samples whose responses are whole lines of demo answers, as many as reach a drawn token
    length (whole lines keep the text one the chat template renders as the tokenizer would);
    returns the response lengths in tokens."""
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET_DIR)
    chats = [json.loads(line)["messages"] for line in DEMO_TRAIN_DATA.read_text().splitlines()]
    lines = [line for chat in chats for line in chat[-1]["content"].splitlines() if line.strip()]
    line_tokens = [len(tokenizer.encode(line + "\n", add_special_tokens=False)) for line in lines]
    rng = random.Random(args.seed)
    lengths = []
    with path.open("w") as f:
        for _ in range(args.samples):
            want, start = rng.randint(args.min_tokens, args.max_tokens), rng.randrange(len(lines))
            picked, n = [], 0
            while n < want:
                i = (start + len(picked)) % len(lines)
                picked.append(lines[i])
                n += line_tokens[i]
            f.write(json.dumps({"messages": [{"role": "user", "content": rng.choice(chats)[0]["content"]},
                                             {"role": "assistant", "content": "\n".join(picked)}]}) + "\n")
            lengths.append(n)
    return lengths


def main() -> None:
    (args,) = cli_parser(AssetArgs).parse_args_into_dataclasses()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = write_chats(args, out / "train.jsonl")
    write_target(args, out / "target")
    print(f"wrote {out / 'target'} ({args.num_layers} layers, hidden {args.hidden_size}, vocab {args.vocab_size}) "
          f"and {len(lengths)} chats of {min(lengths)}-{max(lengths)} response tokens to {out / 'train.jsonl'}")


if __name__ == "__main__":
    main()
