"""Regenerate the assistant replies of a chat dataset with the target itself, so the drafter
learns what the target says rather than what the dataset says.

    python -m dflash.regenerate --target /models/Qwen3-8B --prompts chats.jsonl --output regen.jsonl
    python -m dflash.regenerate ... --sampling target --thinking on --max-new-tokens 4096
    torchrun --nproc_per_node 8 -m dflash.regenerate ...   (deepspeed --num_gpus 8 --module, accelerate launch -m)

Each conversation keeps its turns up to the last user turn; the final reply is replaced by the
target's, and "target_reply" records the ids the target emitted (its stop token included), why
the reply ended ("stop" | "length") and the prompt's thinking mode. With vLLM installed and a GPU
visible, vLLM generates (`--engine auto`, the default); otherwise, for the families
dflash.target.static runs (Llama, Mistral, Qwen2/3), the static-cache engine does (`fast`: CUDA
graphs, one replay per token for a whole batch; greedy, or sampled inside the graph; continuous
batching, a finished row taking the next prompt at once, with rows sized from the free memory),
else HF generation (`hf`). Both run longest prompts first, at most --batch-tokens (rows x (longest
prompt + new tokens)) per batch when it is set, so an out-of-memory shows in the first batch. Replies are kept exactly as the target wrote them (whitespace included).
Under a launcher each rank generates a share of the prompts on its own GPU (dealt longest first,
so the shares match in count and length). Each rank appends its finished replies to its own
partial file (dflash.data.partials) as they come, so a killed run resumes where it stopped, with
any number of ranks; at the end rank 0 writes <output>, every conversation in input order, usable
as --train-data. Greedy by default; `--sampling target` uses the target's generation_config
(temperature, top_p, top_k; when the config sets more, such as a repetition penalty,
`--engine auto` picks HF generation over the fast engine). `--thinking on|off` is passed to chat
templates that know it (enable_thinking; the default, auto, follows the template's own), and each
record's target_reply.thinking says the mode it was resolved to (dflash/data/thinking.py).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch.nn.attention import sdpa_kernel
from transformers import GenerationConfig

from dflash.data.chat_formats import DataError, Messages, load_chat_jsonl
from dflash.data.partials import PartialSink, partial_path, read_partials, write_output
from dflash.data.thinking import THINKING_FLAG_VALUES, THINKING_HELP, resolve_thinking, thinking_kwargs
from dflash.data.tokenization import load_tokenizer, many_prompt_ids, prompt_messages
from dflash.data.tokenizer_match import check_tokenizer_matches_target
from dflash.target.frozen import SHAPE_FREE_SDPA, FrozenTarget, TargetError, load_target_config
from dflash.target.generate import generate_batches, stop_token_ids
from dflash.target.graphs import GraphReplays
from dflash.target.gguf import gguf_file, is_model_path, resolve_target
from dflash.target.sampling import Sampling
from dflash.target.static import FAST_FAMILIES
from dflash.util.cli import ConfigError, cli_parser, user_error, without_launcher_flags
from dflash.util.files import output_dir_problem
from dflash.util.ranks import PeerError, RankGroup, launched, pin_local_gpu
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
    allow_tokenizer_mismatch: bool = field(default=False, metadata={
        "help": "generate although --tokenizer's special ids or vocabulary differ from --target's"})
    max_new_tokens: int = 2048
    batch_tokens: int = field(default=0, metadata={
        "help": "hf and fast engines: at most rows x (the batch's longest prompt + --max-new-tokens) per batch; "
                "0: the fast engine sizes its batch from the target's shapes and the free memory, hf uses "
                f"{HF_BATCH_TOKENS}"})
    engine: str = field(default="auto", metadata={
        "help": "auto (vllm when it is installed and a GPU is visible, else fast where it applies, else hf) | "
                "fast (static KV cache, CUDA graphs; Llama, Mistral, Qwen2/3) | hf | vllm"})
    sampling: str = field(default="greedy", metadata={"help": "greedy | target (the target's generation_config)"})
    temperature: float | None = field(default=None, metadata={
        "help": "--sampling target: in place of the target's temperature (a GGUF target has none: HF's 1.0)"})
    top_p: float | None = field(default=None, metadata={"help": "--sampling target: in place of the target's top-p"})
    top_k: int | None = field(default=None, metadata={"help": "--sampling target: in place of the target's top-k "
                                                              "(0: every token)"})
    thinking: str = field(default="auto", metadata={"help": THINKING_HELP})
    limit: int = field(default=0, metadata={"help": "only the first N conversations (0: all)"})
    device: str = "auto"
    dtype: str = field(default="bfloat16", metadata={"help": "bfloat16 | float32"})
    seed: int = field(default=0, metadata={"help": "--sampling target: rank r of a launch draws with seed + r"})
    peer_timeout_s: float = field(default=1800.0, metadata={
        "help": "under a launcher: how long a rank waits for another (start-up, the end of its share) before "
                "it stops with an error naming it; a rank that dies is seen at once"})


def check_args(args: RegenerateArgs) -> None:
    problems = [
        (args.max_new_tokens >= 1, f"--max-new-tokens {args.max_new_tokens}: use at least 1"),
        (args.batch_tokens >= 0, f"--batch-tokens {args.batch_tokens}: use 0 (sized from memory) or a token count"),
        (args.engine in ("auto", "fast", "hf", "vllm"), f"--engine {args.engine}: use auto, fast, hf or vllm"),
        (args.engine != "vllm" or vllm_available(), "--engine vllm: vllm is not installed; pip install vllm, "
                                                    "or use --engine hf"),
        (args.sampling in ("greedy", "target"), f"--sampling {args.sampling}: use greedy or target"),
        (args.sampling == "target" or sampling_overrides(args) == {},
         "--temperature, --top-p and --top-k apply to sampled replies: add --sampling target"),
        (args.temperature is None or args.temperature > 0, f"--temperature {args.temperature}: use more than 0"),
        (args.top_p is None or 0 < args.top_p <= 1, f"--top-p {args.top_p}: use a value in (0, 1]"),
        (args.top_k is None or args.top_k >= 0, f"--top-k {args.top_k}: use 0 (every token) or a count"),
        (args.thinking in THINKING_FLAG_VALUES, f"--thinking {args.thinking}: use {', '.join(THINKING_FLAG_VALUES)}"),
        (args.dtype in ("bfloat16", "float32"), f"--dtype {args.dtype}: use bfloat16 or float32"),
        (args.limit >= 0, f"--limit {args.limit}: use 0 (all) or a count"),
        (args.peer_timeout_s > 0, f"--peer-timeout-s {args.peer_timeout_s:g}: use a number of seconds above 0"),
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


def split_by_length(sizes: dict[int, int], world_size: int) -> list[list[int]]:
    """Each rank's share of the prompts: longest first, dealt in turn, so the shares differ by at
    most one prompt and have about the same lengths."""
    order = sorted(sizes, key=lambda i: (-sizes[i], i))
    return [order[rank::world_size] for rank in range(world_size)]


def prompt_size(messages: Messages) -> int:
    """The prompt's length in characters: near enough to its length in tokens to share the prompts
    out before any rank tokenizes them (each tokenizes its own share only)."""
    return sum(len(str(turn.get("content") or "")) for turn in prompt_messages(messages))


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


def sampling_overrides(args: RegenerateArgs) -> dict:
    """The sampling settings given on the command line, by generation-config name."""
    given = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    return {name: value for name, value in given.items() if value is not None}


def generation_settings(model, args: RegenerateArgs, pad_id: int) -> dict:
    settings = {"max_new_tokens": args.max_new_tokens, "pad_token_id": pad_id}
    if args.sampling == "greedy":
        return {**settings, "do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    config = model.generation_config
    return {**settings, "do_sample": True, "temperature": config.temperature, "top_p": config.top_p,
            "top_k": config.top_k, **sampling_overrides(args)}


def emitted_reply(row: list[int], stop_ids: set[int]) -> tuple[list[int], str]:
    """(the reply's ids up to and including its first stop token, "stop"), or (all of `row`,
    "length") when it has none: it was cut at --max-new-tokens."""
    end = next((i for i, token in enumerate(row) if token in stop_ids), None)
    return (row, "length") if end is None else (row[: end + 1], "stop")


@torch.no_grad()
def generate_batch(model, prompts: list[list[int]], settings: dict, pad_id: int,
                   stop_ids: set[int]) -> list[tuple[list[int], str]]:
    """Left-padded batched generation; each row's emitted_reply."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    with sdpa_kernel(SHAPE_FREE_SDPA):  # each step's key length is new (dflash.target.frozen)
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), **settings)
    return [emitted_reply(row, stop_ids) for row in out[:, width:].tolist()]


def load_target(args: RegenerateArgs) -> FrozenTarget:
    device = pick_device(args.device, 0)  # a rank of a launch sees its own GPU alone (pin_local_gpu)
    target = FrozenTarget.load(args.target, [0], getattr(torch, args.dtype), device)
    torch.manual_seed(args.seed)
    return target


def target_generation_config(target: str) -> GenerationConfig:
    """The target's generation_config.json; without one, what HF generation derives from its config."""
    try:
        return GenerationConfig.from_pretrained(target)
    except OSError:
        return GenerationConfig.from_model_config(load_target_config(target))


def target_reply(token_ids: list[int], finish_reason: str, args: RegenerateArgs) -> dict:
    """The output record's "target_reply": the ids the target emitted for the final reply (its stop
    token included when finish_reason is "stop"; "length": cut at --max-new-tokens), and the
    thinking mode the prompt was rendered in. Training appends token_ids to the re-rendered prompt."""
    return {"token_ids": token_ids, "finish_reason": finish_reason, "thinking": args.thinking}


def reply_text(tokenizer, token_ids: list[int], finish_reason: str) -> str:
    """The reply as the assistant turn's text: without its stop token (nor other special tokens)."""
    return tokenizer.decode(token_ids[:-1] if finish_reason == "stop" else token_ids, skip_special_tokens=True)


def hf_generate(args: RegenerateArgs, tokenizer, prompts: dict[int, list[int]]):
    """Batched HF generation; yields (indices, [(token_ids, finish_reason)]) per batch."""
    model = load_target(args).model
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stop_ids = stop_token_ids(model.generation_config, tokenizer)
    settings = generation_settings(model, args, pad_id)
    lengths = {i: len(p) for i, p in prompts.items()}
    for batch in batches_by_length(lengths, args.max_new_tokens, args.batch_tokens or HF_BATCH_TOKENS):
        yield batch, generate_batch(model, [prompts[i] for i in batch], settings, pad_id, stop_ids)


def fast_sampling(args: RegenerateArgs) -> Sampling | None:
    """The static-cache engine's draw: None (greedy), or the target's own sampling settings;
    a TargetError when they use what it does not implement."""
    if args.sampling == "greedy":
        return None
    config = target_generation_config(args.target)
    config.update(**sampling_overrides(args))
    return Sampling.of(config)


def fast_generate(args: RegenerateArgs, tokenizer, prompts: dict[int, list[int]]):
    """Generation on the static-cache target, greedy or sampled; yields like hf_generate (the engine's
    replies keep the stop token that ended them)."""
    sampling = fast_sampling(args)
    target = load_target(args)
    stop_ids = stop_token_ids(target.model.generation_config, tokenizer)
    yield from generate_batches(target, prompts, args.max_new_tokens, stop_ids, args.batch_tokens, sampling)
    if GraphReplays.captures:
        logger.info("CUDA graphs: %d captured, %.1f s in all (a batch's step is captured again whenever it "
                    "changes shape)", GraphReplays.captures, GraphReplays.capture_seconds)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_generate(args: RegenerateArgs, tokenizer, prompts: dict[int, list[int]]):
    """vLLM schedules its own batches; prompts go in chunks of VLLM_CHUNK so that finished replies
    reach the partial file (and the log) as the run goes. Its replies end at the stop ids of the
    other engines (it adds the generation config's end-of-sequence ids itself)."""
    if launched().world_size > 1:  # a forked engine process would inherit this rank's process group
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.target, tokenizer=args.tokenizer or args.target, dtype=args.dtype, seed=args.seed)
    stop_ids = stop_token_ids(target_generation_config(args.target), tokenizer)
    if args.sampling == "greedy":
        params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, stop_token_ids=sorted(stop_ids))
    else:  # the target's generation_config, as vLLM reads it
        params = llm.get_default_sampling_params()
        params.max_tokens = args.max_new_tokens
        for name, value in sampling_overrides(args).items():
            setattr(params, name, -1 if name == "top_k" and value == 0 else value)  # vLLM's "every token"
        stop_ids |= set(params.stop_token_ids or ())
    order = sorted(prompts, key=lambda i: (-len(prompts[i]), i))
    for first in range(0, len(order), VLLM_CHUNK):
        batch = order[first: first + VLLM_CHUNK]
        outputs = llm.generate([{"prompt_token_ids": prompts[i]} for i in batch], params, use_tqdm=False)
        yield batch, [emitted_reply(list(out.outputs[0].token_ids), stop_ids) for out in outputs]


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


def served_target(args: RegenerateArgs, group: RankGroup) -> RegenerateArgs:
    """`args` with --target an HF folder: a GGUF is de-quantized by rank 0 (and by the first rank of
    a node that does not share its filesystem) while the others wait. Rank r of a launch samples
    with seed + r, so that ranks do not repeat each other's draws."""
    launch = group.launch
    if gguf_file(args.target) is not None:
        for converts in (launch.is_main, launch.local_rank == 0):
            if converts:
                resolve_target(args.target)
            group.barrier("de-quantizing the GGUF target")
    return replace(args, target=resolve_target(args.target), seed=args.seed + launch.rank)


def generate_share(args: RegenerateArgs, tokenizer, conversations: list[Messages], share: list[int],
                   sink: PartialSink) -> tuple[int, int]:
    """This rank's replies, appended to its partial file batch by batch: (replies, new tokens)."""
    if os.environ.get("TOKENIZERS_PARALLELISM", "").lower() in ("0", "false", "off", "no"):
        # a common setting in training scripts (it silences a warning after fork); here it costs a minute
        logger.warning("TOKENIZERS_PARALLELISM=%s holds the tokenizer to one core: %d prompts are tokenized on it "
                       "(launch/real.sh's 63,671, 25M tokens: 51 s on one core, 26 s on two); unset it to use "
                       "them all", os.environ["TOKENIZERS_PARALLELISM"], len(share))
    prompts = dict(zip(share, many_prompt_ids(tokenizer, [conversations[i] for i in share],
                                              **thinking_kwargs(args.thinking))))
    engine = pick_engine(args)
    logger.info("generating with %s", engine.__name__)
    started, new_tokens, finished = time.perf_counter(), 0, 0
    for batch, replies in engine(args, tokenizer, prompts):
        for index, (token_ids, finish_reason) in zip(batch, replies):
            sink.write(index, reply_text(tokenizer, token_ids, finish_reason),
                       target_reply(token_ids, finish_reason, args))
            new_tokens += len(token_ids)
        sink.flush()
        finished += len(batch)
        seconds = time.perf_counter() - started
        logger.info("%d/%d generated, %.1f conversations/s, %.0f new tokens/s", finished, len(share),
                    finished / seconds, new_tokens / seconds)
    return finished, new_tokens


def finished_indices(output: Path) -> set[int]:
    """The conversations some rank of an earlier run finished (rank 0 reads every partial file)."""
    lines, dropped = read_partials(output)
    if dropped:
        logger.warning("%d lines of the partial files beside %s are generated again: the torn last line of a "
                       "killed rank, or a line without the reply's token ids (an older format)", dropped, output)
    return set(lines)


def unseen_partial_files(output: Path, world_size: int) -> list[str]:
    """The ranks' partial files rank 0 cannot see (each rank made its own by now)."""
    return [str(path) for path in (partial_path(output, rank) for rank in range(world_size)) if not path.is_file()]


def regenerate(args: RegenerateArgs) -> Path:
    """--output from --prompts; a rank of a launch generates its share, and rank 0 writes the file."""
    launch = launched()
    check_args(args)
    if launch.world_size > 1:
        pin_local_gpu(launch.local_rank)
    conversations = load_chat_jsonl(args.prompts, require_reply=False)
    if args.limit:
        conversations = conversations[: args.limit]
    tokenizer = load_tokenizer(args.tokenizer or args.target)
    check_tokenizer_matches_target(tokenizer, args.target, args.tokenizer or args.target, args.allow_tokenizer_mismatch)
    args = replace(args, thinking=resolve_thinking(tokenizer, args.thinking))  # recorded as resolved
    output = Path(args.output)
    with RankGroup(launch, args.peer_timeout_s, "--peer-timeout-s") as group:
        done = group.from_main(lambda: finished_indices(output), "reading the partial files")
        todo = [i for i in range(len(conversations)) if i not in done]
        share = split_by_length({i: prompt_size(conversations[i]) for i in todo}, launch.world_size)[launch.rank]
        logger.info("%d conversations, %d already done (in %s and the .rank<r>.partial files beside it), %d to "
                    "generate%s", len(conversations), len(done), partial_path(output, 0), len(todo),
                    f" over {launch.world_size} ranks ({len(share)} here)" if launch.world_size > 1 else "")
        served = served_target(args, group) if todo else args
        started = time.perf_counter()
        with PartialSink(partial_path(output, launch.rank)) as sink:
            unseen = group.from_main(lambda: unseen_partial_files(output, launch.world_size),
                                     "making the partial files")
            if unseen:
                raise ConfigError(f"--output {output}: rank 0 does not see the partial files {', '.join(unseen)} "
                                  "that other ranks made: put --output on a filesystem that every node shares")
            group.open_reports(2)
            counts = generate_share(served, tokenizer, conversations, share, sink) if share else (0, 0)
        reports = group.report(list(counts), "finishing its share of the replies")
        if launch.is_main:
            if launch.world_size > 1 and todo:
                replies, new_tokens = map(sum, zip(*reports))
                logger.info("%d ranks: %d replies, %.0f new tokens/s", launch.world_size, replies,
                            new_tokens / (time.perf_counter() - started))
            write_output(output, conversations, read_partials(output)[0])
            logger.info("wrote %d conversations to %s", len(conversations), output)
    return output


def main(argv: list[str] | None = None) -> int:
    argv = without_launcher_flags(sys.argv[1:] if argv is None else argv)
    (args,) = cli_parser(RegenerateArgs).parse_args_into_dataclasses(argv)
    try:
        setup_logging(launched().rank)
        regenerate(args)
    except (ConfigError, DataError, TargetError) as err:
        return user_error(err)
    except PeerError as err:
        print(f"error: {err}. Every reply a rank finished is kept in the partial files beside {args.output}: run "
              "the same command again, with any number of ranks, to resume", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
