"""Regenerate the assistant replies of a chat dataset with the target itself, so the drafter
learns what the target says rather than what the dataset says.

    python -m dflash.regenerate --target /models/Qwen3-8B --prompts chats.jsonl --output regen.jsonl
    python -m dflash.regenerate ... --sampling target --thinking on --max-new-tokens 4096

Each conversation keeps its turns up to the last user turn; the final reply is replaced by the
target's. With vLLM installed and a GPU visible, vLLM generates (`--engine auto`, the default);
otherwise, for the families dflash.target.static runs (Llama, Mistral, Qwen2/3), the
static-cache engine does (`fast`: CUDA graphs, one replay per token for a whole batch; greedy, or
sampled inside the graph, continuous batching with rows sized from the free memory), else HF
generation (`hf`). Both run longest prompts first, at most --batch-tokens (rows x (longest
prompt + new tokens)) per batch when it is set, so an out-of-memory shows in the first batch. Replies are kept exactly as the target wrote them (whitespace included).
Finished replies are appended to <output>.partial as they come, so a killed run resumes where
it stopped; at the end <output> holds every conversation in input order, usable as
--train-data. Greedy by default; `--sampling target` uses the target's generation_config
(temperature, top_p, top_k; when the config sets more, such as a repetition penalty,
`--engine auto` picks HF generation over the fast engine). `--thinking on|off` is passed to chat templates that know it
(enable_thinking).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from transformers import GenerationConfig

from dflash.data.chat_formats import DataError, load_chat_jsonl
from dflash.data.tokenization import load_tokenizer, prompt_ids, prompt_messages
from dflash.target.frozen import FrozenTarget, TargetError, load_target_config
from dflash.target.generate import generate_batches, stop_token_ids
from dflash.target.graphs import GraphReplays
from dflash.target.gguf import is_model_path, resolve_target
from dflash.target.sampling import Sampling
from dflash.target.static import FAST_FAMILIES
from dflash.util.cli import ConfigError, cli_parser, user_error
from dflash.util.files import output_dir_problem, write_text_durably
from dflash.util.runtime import pick_device, setup_logging

logger = logging.getLogger(__name__)
VLLM_CHUNK = 4096
HF_BATCH_TOKENS = 262144  # hf's batch at --batch-tokens 0 (an 8B target's KV cache: 38 GB)


@dataclass
class RegenerateArgs:
    target: str = field(metadata={"help": "HF causal-LM folder that will be served, or a .gguf file (de-quantized "
                                          "once into <file>.hf, or ~/.cache/dflash/)"})
    prompts: str = field(metadata={"help": "chat JSONL; the final assistant turn (if any) is replaced"})
    output: str = field(metadata={"help": "chat JSONL to write (usable as --train-data)"})
    tokenizer: str | None = field(default=None, metadata={"help": "default: --target"})
    max_new_tokens: int = 2048
    batch_tokens: int = field(default=0, metadata={
        "help": "hf and fast engines: at most rows x (the batch's longest prompt + --max-new-tokens) per batch; "
                "0: the fast engine sizes its batch from the target's shapes and the free memory, hf uses "
                f"{HF_BATCH_TOKENS}"})
    engine: str = field(default="auto", metadata={
        "help": "auto (vllm when it is installed and a GPU is visible, else fast where it applies, else hf) | "
                "fast (static KV cache, CUDA graphs; Llama, Mistral, Qwen2/3) | hf | vllm"})
    sampling: str = field(default="greedy", metadata={"help": "greedy | target (the target's generation_config)"})
    thinking: str = field(default="off", metadata={"help": "off | on, for chat templates with enable_thinking"})
    limit: int = field(default=0, metadata={"help": "only the first N conversations (0: all)"})
    device: str = "auto"
    dtype: str = field(default="bfloat16", metadata={"help": "bfloat16 | float32"})
    seed: int = 0


def check_args(args: RegenerateArgs) -> None:
    problems = [
        (args.max_new_tokens >= 1, f"--max-new-tokens {args.max_new_tokens}: use at least 1"),
        (args.batch_tokens >= 0, f"--batch-tokens {args.batch_tokens}: use 0 (sized from memory) or a token count"),
        (args.engine in ("auto", "fast", "hf", "vllm"), f"--engine {args.engine}: use auto, fast, hf or vllm"),
        (args.engine != "vllm" or vllm_available(), "--engine vllm: vllm is not installed; pip install vllm, "
                                                    "or use --engine hf"),
        (args.sampling in ("greedy", "target"), f"--sampling {args.sampling}: use greedy or target"),
        (args.thinking in ("off", "on"), f"--thinking {args.thinking}: use off or on"),
        (args.dtype in ("bfloat16", "float32"), f"--dtype {args.dtype}: use bfloat16 or float32"),
        (args.limit >= 0, f"--limit {args.limit}: use 0 (all) or a count"),
        (is_model_path(args.target),
         f"--target {args.target}: no such folder or .gguf file; pass a local HF model folder or a GGUF file"),
        (Path(args.prompts).is_file(), f"--prompts {args.prompts}: no such file; pass a chat JSONL file"),
        (not Path(args.output).is_dir(), f"--output {args.output} is a folder: pass a file path in it, such as "
                                         f"{Path(args.output) / 'regen.jsonl'}"),
    ]
    for ok, message in problems:
        if not ok:
            raise ConfigError(message)
    folder = Path(args.output).parent
    problem = output_dir_problem(folder)  # made now, not found missing after hours of generation
    if problem:
        raise ConfigError(f"--output {args.output}: its folder {folder} {problem}; pass a path you can write to")


def batches_by_length(lengths: dict[int, int], max_new_tokens: int, batch_tokens: int) -> list[list[int]]:
    """Indices longest prompt first, cut so rows x (longest prompt + max_new_tokens) stays
    within batch_tokens (a single row may exceed it: it has to run anyway)."""
    order = sorted(lengths, key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for index in order:
        if batches and (len(batches[-1]) + 1) * (lengths[batches[-1][0]] + max_new_tokens) <= batch_tokens:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


def read_done(partial: Path) -> dict[int, str]:
    """Replies already generated by an earlier, interrupted run (a torn last line is dropped)."""
    done: dict[int, str] = {}
    if partial.is_file():
        for line in partial.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[int(record["index"])] = record["reply"]
    return done


def generation_settings(model, args: RegenerateArgs, pad_id: int) -> dict:
    settings = {"max_new_tokens": args.max_new_tokens, "pad_token_id": pad_id}
    if args.sampling == "greedy":
        return {**settings, "do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    config = model.generation_config
    return {**settings, "do_sample": True, "temperature": config.temperature, "top_p": config.top_p,
            "top_k": config.top_k}


@torch.no_grad()
def generate_batch(model, prompts: list[list[int]], settings: dict, pad_id: int, stop_ids: set[int]):
    """Left-padded batched generation; returns each row's new token ids up to its first stop."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), **settings)
    replies = []
    for row in out[:, width:].tolist():
        stop = next((i for i, token in enumerate(row) if token in stop_ids), len(row))
        replies.append(row[:stop])
    return replies


def load_target(args: RegenerateArgs) -> FrozenTarget:
    device = pick_device(args.device, 0)
    target = FrozenTarget.load(args.target, [0], getattr(torch, args.dtype), device)
    torch.manual_seed(args.seed)
    return target


def reply(tokenizer, tokens: list[int]) -> tuple[str, int]:
    return tokenizer.decode(tokens, skip_special_tokens=True), len(tokens)


def hf_generate(args: RegenerateArgs, tokenizer, prompts: dict[int, list[int]], todo: dict[int, int]):
    """Batched HF generation; yields (indices, [(reply text, new token count)]) per batch."""
    model = load_target(args).model
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stop_ids = stop_token_ids(model, tokenizer)
    settings = generation_settings(model, args, pad_id)
    for batch in batches_by_length(todo, args.max_new_tokens, args.batch_tokens or HF_BATCH_TOKENS):
        replies = generate_batch(model, [prompts[i] for i in batch], settings, pad_id, stop_ids)
        yield batch, [reply(tokenizer, r) for r in replies]


def fast_sampling(args: RegenerateArgs) -> Sampling | None:
    """The static-cache engine's draw: None (greedy), or the target's own sampling settings;
    a TargetError when they use what it does not implement."""
    if args.sampling == "greedy":
        return None
    try:
        config = GenerationConfig.from_pretrained(args.target)
    except OSError:  # no generation_config.json: HF generation samples with its defaults
        config = GenerationConfig()
    return Sampling.of(config)


def fast_generate(args: RegenerateArgs, tokenizer, prompts: dict[int, list[int]], todo: dict[int, int]):
    """Generation on the static-cache target, greedy or sampled; yields like hf_generate (the
    engine's replies keep the stop token that ended them: it is not part of the text)."""
    sampling = fast_sampling(args)
    target = load_target(args)
    stop_ids = stop_token_ids(target.model, tokenizer)
    todo_prompts = {i: prompts[i] for i in todo}
    for batch, replies in generate_batches(target, todo_prompts, args.max_new_tokens, stop_ids, args.batch_tokens,
                                           sampling):
        yield batch, [(reply(tokenizer, tokens[:-1] if finish == "stop" else tokens)[0], len(tokens))
                      for tokens, finish in replies]
    if GraphReplays.captures:
        logger.info("CUDA graphs: %d captured, %.1f s in all (a batch's step is captured again whenever it "
                    "changes shape)", GraphReplays.captures, GraphReplays.capture_seconds)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_generate(args: RegenerateArgs, tokenizer, prompts: dict[int, list[int]], todo: dict[int, int]):
    """vLLM schedules its own batches; prompts go in chunks of VLLM_CHUNK so that finished replies
    reach the .partial file (and the log) as the run goes."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.target, tokenizer=args.tokenizer or args.target, dtype=args.dtype, seed=args.seed)
    if args.sampling == "greedy":
        params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    else:  # the target's generation_config, as vLLM reads it
        params = llm.get_default_sampling_params()
        params.max_tokens = args.max_new_tokens
    order = sorted(todo, key=lambda i: (-todo[i], i))
    for first in range(0, len(order), VLLM_CHUNK):
        batch = order[first: first + VLLM_CHUNK]
        outputs = llm.generate([{"prompt_token_ids": prompts[i]} for i in batch], params, use_tqdm=False)
        yield batch, [(out.outputs[0].text, len(out.outputs[0].token_ids)) for out in outputs]


def pick_engine(args: RegenerateArgs):
    """The engine for `args` (its target already an HF folder)."""
    if args.engine == "vllm" or (args.engine == "auto" and vllm_available() and torch.cuda.is_available()
                                 and args.device != "cpu"):
        return vllm_generate
    if args.engine == "fast":
        return fast_generate
    if args.engine == "auto" and load_target_config(args.target).model_type in FAST_FAMILIES:
        try:
            fast_sampling(args)
            return fast_generate
        except TargetError:  # sampling settings only HF generation applies
            pass
    return hf_generate


def regenerate(args: RegenerateArgs) -> Path:
    check_args(args)
    conversations = load_chat_jsonl(args.prompts, require_reply=False)
    if args.limit:
        conversations = conversations[: args.limit]
    tokenizer = load_tokenizer(args.tokenizer or args.target)
    template = {"enable_thinking": args.thinking == "on"}
    prompts = {i: prompt_ids(tokenizer, messages, **template) for i, messages in enumerate(conversations)}
    output = Path(args.output)
    partial = output.with_name(output.name + ".partial")
    done = read_done(partial)
    todo = {i: len(p) for i, p in prompts.items() if i not in done}
    logger.info("%d conversations, %d already done (%s), %d to generate", len(prompts), len(done), partial, len(todo))
    if todo:
        served = replace(args, target=resolve_target(args.target))  # a GGUF's de-quantized folder
        engine = pick_engine(served)
        logger.info("generating with %s", engine.__name__)
        started, new_tokens, finished = time.perf_counter(), 0, 0
        with partial.open("a", encoding="utf-8") as sink:
            for batch, replies in engine(served, tokenizer, prompts, todo):
                for index, (text, count) in zip(batch, replies):
                    sink.write(json.dumps({"index": index, "reply": text}) + "\n")
                    done[index] = text
                    new_tokens += count
                sink.flush()
                finished += len(batch)
                seconds = time.perf_counter() - started
                logger.info("%d/%d generated, %.1f conversations/s, %.0f new tokens/s", finished, len(todo),
                            finished / seconds, new_tokens / seconds)
    records = [{"messages": [*prompt_messages(messages), {"role": "assistant", "content": done[i]}]}
               for i, messages in enumerate(conversations)]
    write_text_durably(output, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    partial.unlink(missing_ok=True)
    logger.info("wrote %d conversations to %s", len(records), output)
    return output


def main(argv: list[str] | None = None) -> int:
    (args,) = cli_parser(RegenerateArgs).parse_args_into_dataclasses(argv)
    setup_logging(0)
    try:
        regenerate(args)
    except (ConfigError, DataError, TargetError) as err:
        return user_error(err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
