"""Regeneration with the target itself, on the demo target and its 64 held-out prompts: batched
left-padded generation (HF's and the static-cache engine) equals one-at-a-time greedy decoding,
each record keeps the ids the target emitted (its stop token included) and the reply's exact text,
an interrupted run resumes, the output trains as --train-data, and 2 ranks under torchrun write the
one-process output byte for byte, resuming after a rank died."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import REPO, free_port
from dflash.data.chat_formats import load_chat_jsonl
from dflash.data.dataset import TokenDataset
from dflash.data.prepare import prepare_dataset
from dflash.data.regenerate import main as regenerate_main
from dflash.data.tokenization import load_tokenizer, prompt_ids, prompt_messages, tokenize_conversation
from dflash.demo import DEMO_HELDOUT_DATA, DEMO_TARGET_DIR

NEW_TOKENS = 24
# The static-cache engine's rows hold 512 cache columns each: 1500 batch tokens would give it 2 rows,
# where HF's batches of 1500 tokens hold 10 to 17 of these prompts; 12 rows bring it level
FAST_ROWS = ("--engine", "fast", "--batch-tokens", str(12 * 512))


def run(tmp_path, *extra: str) -> list[dict]:
    out = tmp_path / "regen.jsonl"
    argv = ["--target", str(DEMO_TARGET_DIR), "--prompts", str(DEMO_HELDOUT_DATA), "--output", str(out),
            "--max-new-tokens", str(NEW_TOKENS), "--batch-tokens", "1500", "--dtype", "float32", "--device", "cpu",
            *extra]
    assert regenerate_main(argv) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_regenerated_replies_are_the_targets_greedy_replies(tmp_path, capfd, engine):
    records = run(tmp_path, *(FAST_ROWS if engine == "fast" else ("--engine", engine)))
    log = capfd.readouterr().err
    source = load_chat_jsonl(DEMO_HELDOUT_DATA)
    assert len(records) == len(source) == 64
    for record, messages in zip(records, source):
        assert record["messages"][:-1] == prompt_messages(messages)
        assert record["messages"][-1]["role"] == "assistant"
    assert "64/64 generated" in log and "new tokens/s" in log and f"generating with {engine}_generate" in log
    tokenizer = load_tokenizer(str(DEMO_TARGET_DIR))
    eos = tokenizer.eos_token_id  # the demo target's only stop id
    for record in records:
        reply = record["target_reply"]
        ids, reason = reply["token_ids"], reply["finish_reason"]
        assert reply["thinking"] == "none" and eos not in ids[:-1]  # the demo template has no switch
        assert (reason, ids[-1] == eos) in (("stop", True), ("length", False)) and len(ids) <= NEW_TOKENS
        assert record["messages"][-1]["content"] == tokenizer.decode(ids, skip_special_tokens=True)
    stopped = [i for i, r in enumerate(records) if r["target_reply"]["finish_reason"] == "stop"]
    assert stopped, "some reply ends within the limit"
    model = AutoModelForCausalLM.from_pretrained(DEMO_TARGET_DIR, dtype=torch.float32).eval()
    lengths = [len(prompt_ids(tokenizer, m)) for m in source]
    for i in sorted(range(64), key=lengths.__getitem__)[::16] + stopped[:1]:  # short to long, and one that stops
        ids = torch.tensor([prompt_ids(tokenizer, source[i])])
        with torch.no_grad():
            alone = model.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                   pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
        assert records[i]["target_reply"]["token_ids"] == alone, i  # the stop token included, nothing after it
        if eos in alone:
            alone = alone[:alone.index(eos)]
        assert records[i]["messages"][-1]["content"] == tokenizer.decode(alone, skip_special_tokens=True), i
        ids, mask = tokenize_conversation(tokenizer, records[i]["messages"])
        assert ids[mask].tolist()[: len(alone)] == alone, "the trained tokens are the target's own tokens"


def test_the_fast_engine_samples_with_the_targets_settings(tmp_path, capfd):
    """--sampling target on the static-cache engine: replies leave the greedy path, a seed
    repeats them, another seed changes them."""
    def replies(folder, *extra):
        folder.mkdir()
        return [r["messages"][-1]["content"] for r in run(folder, *FAST_ROWS, "--limit", "12", *extra)]

    greedy = replies(tmp_path / "greedy")
    sampled = replies(tmp_path / "a", "--sampling", "target", "--seed", "1")
    assert "generating with fast_generate" in capfd.readouterr().err
    assert sampled == replies(tmp_path / "b", "--sampling", "target", "--seed", "1")
    assert sampled != greedy and sampled != replies(tmp_path / "c", "--sampling", "target", "--seed", "2")
    # the command line's settings replace the target's: top-k 1 leaves the most likely token alone
    assert replies(tmp_path / "d", "--sampling", "target", "--seed", "1", "--top-k", "1", "--temperature", "0.7") == greedy


def test_an_interrupted_run_resumes_and_the_output_trains(tmp_path, capfd):
    partial = tmp_path / "regen.jsonl.partial"
    kept = [{"token_ids": [i, 2], "finish_reason": "stop", "thinking": "none"} for i in range(10)]
    partial.write_text("".join(json.dumps({"index": i, "reply": f"kept {i}", "target_reply": kept[i]}) + "\n"
                               for i in range(10))
                       + json.dumps({"index": 10, "reply": "no token ids: an older format"}) + "\n"
                       + '{"index": 11, "rep')  # the torn line of a killed run
    records = run(tmp_path, "--limit", "24")
    log = capfd.readouterr().err
    assert "24 conversations, 10 already done" in log and "2 lines of the partial files" in log
    assert [r["messages"][-1]["content"] for r in records[:10]] == [f"kept {i}" for i in range(10)]
    assert [r["target_reply"] for r in records[:10]] == kept
    assert not partial.exists()
    shard = prepare_dataset(tmp_path / "regen.jsonl", load_tokenizer(str(DEMO_TARGET_DIR)), tmp_path / "shard", 512,
                            cut_replies="keep")  # every record trains, the demo's replies cut at the limit too
    assert len(TokenDataset(shard)) == 24


def test_bad_flags_get_one_line(tmp_path, capsys):
    argv = ["--target", str(tmp_path / "none"), "--prompts", str(DEMO_HELDOUT_DATA), "--output", str(tmp_path / "o")]
    assert regenerate_main(argv) == 2
    assert "--target" in capsys.readouterr().err
    assert regenerate_main([*argv[:1], str(DEMO_TARGET_DIR), *argv[2:], "--sampling", "hot"]) == 2
    assert "--sampling hot: use greedy or target" in capsys.readouterr().err
    assert regenerate_main([*argv[:1], str(DEMO_TARGET_DIR), *argv[2:], "--temperature", "0.7"]) == 2
    assert "--temperature, --top-p and --top-k apply to sampled replies: add --sampling target" in capsys.readouterr().err
    assert regenerate_main([*argv[:1], str(DEMO_TARGET_DIR), *argv[2:], "--sampling", "target", "--top-p", "0"]) == 2
    assert "--top-p 0.0: use a value in (0, 1]" in capsys.readouterr().err
    assert regenerate_main([*argv, "--local_rank=1"]) == 2  # the deepspeed launcher's flag is no error
    assert "--target" in capsys.readouterr().err
    good = [*argv[:1], str(DEMO_TARGET_DIR), *argv[2:4]]
    assert regenerate_main([*good, "--output", str(tmp_path)]) == 2
    assert f"--output {tmp_path} is a folder: pass a file path in it" in capsys.readouterr().err
    under_a_file = DEMO_HELDOUT_DATA / "regen.jsonl"
    assert regenerate_main([*good, "--output", str(under_a_file)]) == 2
    assert (f"--output {under_a_file}: its folder {DEMO_HELDOUT_DATA} is a file, not a folder"
            in capsys.readouterr().err)


def test_engine_choice_and_a_missing_vllm(tmp_path, capfd, monkeypatch):
    import dflash.data.regenerate as regen
    from dflash.data.regenerate import RegenerateArgs, fast_generate, hf_generate, pick_engine

    monkeypatch.setattr(regen, "vllm_available", lambda: False)
    args = RegenerateArgs(target=str(DEMO_TARGET_DIR), prompts=str(DEMO_HELDOUT_DATA), output=str(tmp_path / "o"))
    assert pick_engine(args) is fast_generate  # auto: the static-cache engine for a greedy Qwen3
    args.sampling = "target"
    assert pick_engine(args) is fast_generate  # and for sampling with the target's settings
    penalised = tmp_path / "penalised"  # a target whose generation config sets what only HF applies
    penalised.mkdir()
    for item in DEMO_TARGET_DIR.iterdir():
        (penalised / item.name).symlink_to(item)
    (penalised / "generation_config.json").unlink()
    (penalised / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.3, "eos_token_id": 2}))
    args.target = str(penalised)
    assert pick_engine(args) is hf_generate
    args.sampling = "greedy"
    assert pick_engine(args) is fast_generate
    code = regenerate_main(["--target", str(DEMO_TARGET_DIR), "--prompts", str(DEMO_HELDOUT_DATA),
                            "--output", str(tmp_path / "o.jsonl"), "--engine", "vllm"])
    err = capfd.readouterr().err
    assert code == 2 and "--engine vllm: vllm is not installed" in err and "--engine hf" in err
    assert not (tmp_path / "o.jsonl").exists()


def test_vllm_replies_keep_their_stop_token_and_end_at_the_targets_stop_ids(tmp_path, monkeypatch):
    """vLLM is not installed here: a stand-in with its interface replies to each prompt with the
    stop ids it was given (a reply that stops), or runs to max_tokens (one that does not)."""
    import types

    from dflash.data.regenerate import RegenerateArgs, vllm_generate

    class LLM:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

        def generate(self, requests, params, use_tqdm):
            def reply(ids):
                return [7, *params.stop_token_ids] if len(ids) % 2 else [7] * params.max_tokens
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=tuple(reply(
                r["prompt_token_ids"])))]) for r in requests]

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=types.SimpleNamespace))
    args = RegenerateArgs(target=str(DEMO_TARGET_DIR), prompts=str(DEMO_HELDOUT_DATA), output=str(tmp_path / "o"),
                          max_new_tokens=3)
    tokenizer = load_tokenizer(str(DEMO_TARGET_DIR))
    prompts = {0: [1, 2], 1: [1, 2, 3], 2: [1]}
    [(batch, replies)] = list(vllm_generate(args, tokenizer, prompts))
    assert batch == [1, 0, 2]  # longest first
    eos = tokenizer.eos_token_id  # the demo target's only stop id
    assert replies == [([7, eos], "stop"), ([7, 7, 7], "length"), ([7, eos], "stop")]


def test_prompt_only_conversations_regenerate_like_those_with_a_reply(tmp_path):
    """Prompts are the natural input: a conversation ending in a user turn, or a bare
    {"prompt": ...}, gets the same reply as the same conversation with an old reply."""
    source = load_chat_jsonl(DEMO_HELDOUT_DATA)[:4]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": m[:-1]} if i % 2 else {"prompt": m[0]["content"]}) + "\n"
                               for i, m in enumerate(source)))
    with_replies = run(tmp_path, "--limit", "4")
    folder = tmp_path / "missing" / "folder"  # created, with its parents
    prompt_only = run(folder, "--prompts", str(prompts))  # the later flag wins
    assert prompt_only == with_replies and [r["messages"][:-1] for r in prompt_only] == [m[:-1] for m in source]


# Sharded runs: 8 prompts, each in a batch of its own (--batch-tokens 1), so a prompt's numerics are
# the same whichever rank runs it; what differs is the share-out, the partial files and the merge.
SHARDED = ["--target", str(DEMO_TARGET_DIR), "--prompts", str(DEMO_HELDOUT_DATA), "--limit", "8",
           "--max-new-tokens", "8", "--batch-tokens", "1", "--dtype", "float32", "--device", "cpu"]
# rank 1 of the killed run: dies right after its first reply reaches its partial file, in the
# middle of writing the next line
DIES_AFTER_ITS_FIRST_REPLY = """
import os, sys
from dflash.data.partials import PartialSink
def flush_then_die(sink):
    sink._file.flush()
    sink._file.write('{"index": 99, "rep')
    sink._file.flush()
    os._exit(9)
PartialSink.flush = flush_then_die
from dflash.data.regenerate import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def one_process_output(tmp_path_factory) -> bytes:
    out = tmp_path_factory.mktemp("one") / "regen.jsonl"
    assert regenerate_main([*SHARDED, "--output", str(out)]) == 0
    return out.read_bytes()


def test_two_ranks_under_torchrun_write_the_one_process_output(tmp_path, one_process_output):
    out = tmp_path / "regen.jsonl"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), "-m", "dflash.regenerate", *SHARDED, "--output", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "8 to generate over 2 ranks (4 here)" in proc.stderr and "2 ranks: 8 replies" in proc.stderr
    assert out.read_bytes() == one_process_output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["regen.jsonl"]  # the partial files are gone


def test_a_rank_that_dies_stops_rank_0_with_one_line_and_the_run_resumes(tmp_path, capfd, one_process_output):
    """Ranks started without a launcher, which would stop the others itself: rank 0 finishes its
    share, names rank 1 in one line and exits 1; the rerun, in one process, keeps both ranks'
    finished replies and writes what one process writes."""
    out = tmp_path / "regen.jsonl"
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    argv = [*SHARDED, "--output", str(out), "--peer-timeout-s", "300"]
    logs = [(tmp_path / f"rank{r}.log").open("w+") for r in range(2)]
    ranks = [subprocess.Popen([sys.executable, *(["-m", "dflash.regenerate"] if r == 0 else
                                                  ["-c", DIES_AFTER_ITS_FIRST_REPLY]), *argv],
                              cwd=REPO, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stderr=logs[r], text=True)
             for r in range(2)]
    assert [proc.wait(timeout=600) for proc in ranks] == [1, 9]
    logs[0].seek(0)
    log = logs[0].read()
    assert "Traceback" not in log and [line for line in log.splitlines() if line.startswith("error:")] == [
        f"error: rank 0: rank 1 stopped before 'finishing its share of the replies' (its connection closed): see "
        f"its log for why. Every reply a rank finished is kept in the partial files beside {out}: run the same "
        "command again, with any number of ranks, to resume"]
    assert [len(p.read_text().splitlines()) for p in (tmp_path / "regen.jsonl.partial",
                                                       tmp_path / "regen.jsonl.rank1.partial")] == [4, 2]
    capfd.readouterr()
    assert regenerate_main(argv) == 0
    assert "8 conversations, 5 already done" in capfd.readouterr().err
    assert out.read_bytes() == one_process_output
    assert not list(tmp_path.glob("*.partial"))


def test_a_tokenizer_held_to_one_core_is_named(tmp_path, capfd, monkeypatch):
    """TOKENIZERS_PARALLELISM=false (set by many training scripts) makes the prompts' batch
    tokenization single-threaded: the run says so, and how to undo it; unset, nothing is said."""
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    run(tmp_path, "--limit", "2")
    assert "TOKENIZERS_PARALLELISM" not in capfd.readouterr().err
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    run(tmp_path / "held", "--limit", "2")
    log = capfd.readouterr().err
    assert "TOKENIZERS_PARALLELISM=false holds the tokenizer to one core: 2 prompts are tokenized on it" in log, log
    assert "unset it to use them all" in log
