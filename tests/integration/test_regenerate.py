"""Regeneration with the target itself, on the demo target and its 64 held-out prompts: batched
left-padded generation (HF's and the static-cache engine) equals one-at-a-time greedy decoding,
replies keep the target's exact text, an interrupted run resumes, and the output trains as
--train-data."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash.data.chat_formats import load_chat_jsonl
from dflash.data.dataset import TokenDataset
from dflash.data.prepare import prepare_dataset
from dflash.data.regenerate import main as regenerate_main
from dflash.data.tokenization import load_tokenizer, prompt_ids, prompt_messages, tokenize_conversation
from dflash.demo import DEMO_HELDOUT_DATA, DEMO_TARGET_DIR

NEW_TOKENS = 24


def run(tmp_path, *extra: str) -> list[dict]:
    out = tmp_path / "regen.jsonl"
    argv = ["--target", str(DEMO_TARGET_DIR), "--prompts", str(DEMO_HELDOUT_DATA), "--output", str(out),
            "--max-new-tokens", str(NEW_TOKENS), "--batch-tokens", "1500", "--dtype", "float32", "--device", "cpu",
            *extra]
    assert regenerate_main(argv) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_regenerated_replies_are_the_targets_greedy_replies(tmp_path, capfd, engine):
    records = run(tmp_path, "--engine", engine)
    log = capfd.readouterr().err
    source = load_chat_jsonl(DEMO_HELDOUT_DATA)
    assert len(records) == len(source) == 64
    for record, messages in zip(records, source):
        assert record["messages"][:-1] == prompt_messages(messages)
        assert record["messages"][-1]["role"] == "assistant"
    assert "64/64 generated" in log and "new tokens/s" in log and f"generating with {engine}_generate" in log
    tokenizer = load_tokenizer(str(DEMO_TARGET_DIR))
    model = AutoModelForCausalLM.from_pretrained(DEMO_TARGET_DIR, dtype=torch.float32).eval()
    lengths = [len(prompt_ids(tokenizer, m)) for m in source]
    for i in sorted(range(64), key=lengths.__getitem__)[::16]:  # short to long: rows padded differently
        ids = torch.tensor([prompt_ids(tokenizer, source[i])])
        with torch.no_grad():
            alone = model.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                   pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
        if tokenizer.eos_token_id in alone:
            alone = alone[:alone.index(tokenizer.eos_token_id)]
        assert records[i]["messages"][-1]["content"] == tokenizer.decode(alone, skip_special_tokens=True), i
        ids, mask = tokenize_conversation(tokenizer, records[i]["messages"])
        assert ids[mask].tolist()[: len(alone)] == alone, "the trained tokens are the target's own tokens"


def test_the_fast_engine_samples_with_the_targets_settings(tmp_path, capfd):
    """--sampling target on the static-cache engine: replies leave the greedy path, a seed
    repeats them, another seed changes them."""
    def replies(folder, *extra):
        folder.mkdir()
        return [r["messages"][-1]["content"] for r in run(folder, "--engine", "fast", "--limit", "12", *extra)]

    greedy = replies(tmp_path / "greedy")
    sampled = replies(tmp_path / "a", "--sampling", "target", "--seed", "1")
    assert "generating with fast_generate" in capfd.readouterr().err
    assert sampled == replies(tmp_path / "b", "--sampling", "target", "--seed", "1")
    assert sampled != greedy and sampled != replies(tmp_path / "c", "--sampling", "target", "--seed", "2")


def test_an_interrupted_run_resumes_and_the_output_trains(tmp_path, capfd):
    partial = tmp_path / "regen.jsonl.partial"
    partial.write_text("".join(json.dumps({"index": i, "reply": f"kept {i}"}) + "\n" for i in range(10))
                       + '{"index": 10, "rep')  # the torn line of a killed run
    records = run(tmp_path, "--limit", "24")
    assert "24 conversations, 10 already done" in capfd.readouterr().err
    assert [r["messages"][-1]["content"] for r in records[:10]] == [f"kept {i}" for i in range(10)]
    assert not partial.exists()
    shard = prepare_dataset(tmp_path / "regen.jsonl", load_tokenizer(str(DEMO_TARGET_DIR)), tmp_path / "shard", 512)
    assert len(TokenDataset(shard)) == 24


def test_bad_flags_get_one_line(tmp_path, capsys):
    argv = ["--target", str(tmp_path / "none"), "--prompts", str(DEMO_HELDOUT_DATA), "--output", str(tmp_path / "o")]
    assert regenerate_main(argv) == 2
    assert "--target" in capsys.readouterr().err
    assert regenerate_main([*argv[:1], str(DEMO_TARGET_DIR), *argv[2:], "--sampling", "hot"]) == 2
    assert "--sampling hot: use greedy or target" in capsys.readouterr().err
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
