"""Build the demo drafter data: stdlib code prompts answered by the demo target itself.

A drafter is trained to predict what the target would say, so the assistant turns are
not the original source lines but the target's greedy continuations of the prompts.
Train prompts come from the files the target was trained on; held-out prompts come
from the files that were held out of target training (see ``corpus.is_heldout``).

    python -m dflash.demo.build_data
"""

import argparse
import json
import logging
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from dflash.demo import DEMO_HELDOUT_DATA, DEMO_TARGET_DIR, DEMO_TRAIN_DATA
from dflash.demo.corpus import PROMPT_LINES, SnippetSampler, load_sources, user_prompt
from dflash.util.runtime import pick_device

logger = logging.getLogger(__name__)

# The sampler also draws a continuation window; only its existence matters here (it
# guarantees the prompt stops where real code goes on), its text is discarded.
CONTINUATION_LINES = (1, 1)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-dir", type=Path, default=DEMO_TARGET_DIR)
    parser.add_argument("--train-out", type=Path, default=DEMO_TRAIN_DATA)
    parser.add_argument("--heldout-out", type=Path, default=DEMO_HELDOUT_DATA)
    parser.add_argument("--num-train", type=int, default=2000)
    parser.add_argument("--num-heldout", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=256, help="chat-formatted prompt length cap")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="auto", help="auto (cuda when there is one) | cpu | cuda")
    return parser.parse_args()


def prompt_ids(tokenizer: PreTrainedTokenizerBase, code: str) -> list[int]:
    messages = [{"role": "user", "content": user_prompt(code)}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def sample_prompts(
    tokenizer: PreTrainedTokenizerBase, heldout: bool, count: int, seed: int, max_tokens: int
) -> list[str]:
    """Distinct code snippets whose chat-formatted prompt fits in max_tokens."""
    sampler = SnippetSampler(load_sources(heldout=heldout), seed)
    prompts: dict[str, None] = {}
    while len(prompts) < count:
        code, _ = sampler.sample(PROMPT_LINES, CONTINUATION_LINES)
        if len(prompt_ids(tokenizer, code)) <= max_tokens:
            prompts[code] = None
    return list(prompts)


def finish_response(tokenizer: PreTrainedTokenizerBase, new_ids: list[int]) -> str:
    """Text of one generation, cut at <|im_end|>.

    A generation that hit the token limit is cut back to its last complete line, since
    the target itself was trained to end answers at line boundaries; the chat template
    then closes it with <|im_end|> as if the target had stopped there.
    """
    if tokenizer.eos_token_id in new_ids:
        return tokenizer.decode(new_ids[: new_ids.index(tokenizer.eos_token_id)], skip_special_tokens=True)
    text = tokenizer.decode(new_ids, skip_special_tokens=True)
    return text[: text.rfind("\n")] if "\n" in text else text


@torch.inference_mode()
def generate(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, codes: list[str], args: argparse.Namespace
) -> list[str]:
    """Greedy responses, batched over prompts of similar length to limit padding."""
    encoded = [prompt_ids(tokenizer, code) for code in codes]
    order = sorted(range(len(codes)), key=lambda i: len(encoded[i]))
    responses = [""] * len(codes)
    start = time.monotonic()
    for first in range(0, len(order), args.batch_size):
        chunk = order[first : first + args.batch_size]
        batch = tokenizer.pad({"input_ids": [encoded[i] for i in chunk]}, padding=True, return_tensors="pt")
        batch = batch.to(model.device)
        output = model.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False)
        for row, index in enumerate(chunk):
            responses[index] = finish_response(tokenizer, output[row, batch["input_ids"].shape[1] :].tolist())
        logger.info("generated %d/%d (%.0fs)", first + len(chunk), len(codes), time.monotonic() - start)
    return responses


def write_jsonl(path: Path, codes: list[str], responses: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for code, response in zip(codes, responses, strict=True):
            messages = [
                {"role": "user", "content": user_prompt(code)},
                {"role": "assistant", "content": response},
            ]
            handle.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")


def build_split(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    heldout: bool,
    count: int,
    path: Path,
    args: argparse.Namespace,
) -> None:
    """Sample one split's prompts, answer them with the target and write the JSONL. Empty answers
    are left out: training would skip them as bad samples, with a warning on every run."""
    codes = sample_prompts(tokenizer, heldout, count, args.seed, args.max_prompt_tokens)
    logger.info("%s: generating %d responses", path.name, len(codes))
    answered = [(code, answer) for code, answer in zip(codes, generate(model, tokenizer, codes, args)) if answer.strip()]
    write_jsonl(path, [code for code, _ in answered], [answer for _, answer in answered])
    print(f"wrote {len(answered)} samples to {path} ({len(codes) - len(answered)} empty answers left out)")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.target_dir, padding_side="left")
    # Generate in fp32 from the bf16 checkpoint: CPU bf16 matmuls are slower.
    model = AutoModelForCausalLM.from_pretrained(args.target_dir, dtype=torch.float32).eval().to(pick_device(args.device, 0))
    build_split(model, tokenizer, True, args.num_heldout, args.heldout_out, args)
    build_split(model, tokenizer, False, args.num_train, args.train_out, args)


if __name__ == "__main__":
    main()
