"""python -m dflash.data.magpie end to end on a tiny target that writes ASCII user turns: the
prompts are the target's sampled turns, a seed repeats them, held-out turns stay out, and
python -m dflash.regenerate answers the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_tokenizer import IM_END, make_tiny_tokenizer
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash.data.magpie import main as magpie_main
from dflash.data.regenerate import main as regenerate_main

LETTERS = "aeinost"  # no code word can be spelt with them, so no turn looks like code
END_LOGIT = -1.1  # against 0 for a letter or a space: a turn ends after 25 tokens on average


@pytest.fixture(autouse=True)
def one_thread():
    """A 64-wide model gains nothing from threads, and on a busy machine their spinning costs 30x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def writer(tmp_path_factory) -> Path:
    """A Qwen3 whose next-token distribution is the same after every prefix: its layers add nothing
    (o_proj and down_proj are zero) and every embedding row is the same vector, so the logits are
    lm_head's first column (times 8, the final norm of a one-hot vector of width 64): letters and
    the space at 0, the end-of-turn token at END_LOGIT, everything else at -30."""
    tokenizer = make_tiny_tokenizer()
    config = Qwen3Config(vocab_size=len(tokenizer) + 3, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
                         pad_token_id=tokenizer.pad_token_id)
    model = Qwen3ForCausalLM(config).eval()
    logits = torch.full((config.vocab_size,), -30.0)
    logits[tokenizer.convert_tokens_to_ids(list(LETTERS) + ["Ġ"])] = 0.0
    logits[tokenizer.convert_tokens_to_ids(IM_END)] = END_LOGIT
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()[:, 0] = 1.0
        model.lm_head.weight.zero_()[:, 0] = logits / 8
    folder = tmp_path_factory.mktemp("writer") / "target"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build(target: Path, out: Path, *extra: str, batch: tuple[str, ...] = ("--batch-tokens", "4096")) -> list[dict]:
    argv = ["--target", str(target), "--n", "12", "--out", str(out), "--max-new-tokens", "64", "--min-chars", "5",
            *batch, "--device", "cpu", "--dtype", "float32", *extra]
    assert magpie_main(argv) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_the_target_writes_prompts_that_regenerate_answers(writer, tmp_path, capfd):
    records = build(writer, tmp_path / "prompts.jsonl", batch=())
    log = capfd.readouterr().err
    plans = [line for line in log.splitlines() if "memory plan:" in line]
    assert plans and not any("--batch-tokens" in line for line in plans), "by default the free memory sizes the batch"
    assert [r["id"] for r in records] == [f"magpie:{i}" for i in range(12)]
    texts = [r["messages"][0]["content"] for r in records]
    assert all(r["messages"] == [{"role": "user", "content": t}] for r, t in zip(records, texts))
    assert len(set(texts)) == 12 and all(5 <= len(t) and set(t) <= set(LETTERS + " ") for t in texts)
    assert "user header: '<|im_start|>user\\n'" in log
    assert "cut at --max-new-tokens" in log and "shorter than --min-chars" in log
    assert f"{tmp_path / 'prompts.jsonl'}: 12 prompts, 0 of them code requests" in log
    answered = tmp_path / "regen.jsonl"
    assert regenerate_main(["--target", str(writer), "--prompts", str(tmp_path / "prompts.jsonl"), "--output",
                            str(answered), "--max-new-tokens", "8", "--engine", "fast", "--device", "cpu",
                            "--dtype", "float32"]) == 0
    regenerated = [json.loads(line) for line in answered.read_text().splitlines()]
    assert [r["messages"][0] for r in regenerated] == [r["messages"][0] for r in records]
    assert all(r["messages"][1]["role"] == "assistant" for r in regenerated)


def test_a_seed_repeats_the_prompts_and_held_out_turns_stay_out(writer, tmp_path, capfd):
    first = build(writer, tmp_path / "a.jsonl", "--seed", "4")
    assert build(writer, tmp_path / "b.jsonl", "--seed", "4") == first
    assert build(writer, tmp_path / "c.jsonl", "--seed", "5") != first
    capfd.readouterr()
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(json.dumps({"messages": first[3]["messages"]}) + "\n")
    again = build(writer, tmp_path / "d.jsonl", "--seed", "4", "--heldout", str(heldout))
    assert "1 repeating a --heldout turn" in capfd.readouterr().err
    texts = [r["messages"][0]["content"] for r in again]
    assert first[3]["messages"][0]["content"] not in texts
    assert texts[:3] == [r["messages"][0]["content"] for r in first[:3]]


def test_a_code_share_the_target_cannot_fill_is_reported(writer, tmp_path, capfd):
    """Half code requests, from a target that writes none: steered rows are sampled, the other
    half is written, and the summary says what is missing."""
    records = build(writer, tmp_path / "prompts.jsonl", "--code-share", "0.5", "--max-rounds", "2")
    log = capfd.readouterr().err
    assert len(records) == 6
    assert "steered: '<|im_start|>system\\nYou are a coding assistant." in log
    assert "in 2 rounds" in log and "6 prompts short of --n 12 after --max-rounds 2" in log
    sampled = int(log.split("sampled ")[1].split()[0])
    steered = int(log.split(" with --code-system-prompt")[0].rsplit("(", 1)[1])
    assert 0 < steered < sampled


def test_bad_flags_get_one_line(writer, tmp_path, capsys):
    base = ["--target", str(writer), "--n", "4", "--out", str(tmp_path / "p.jsonl")]
    for extra, message in [
        (["--code-share", "1.5"], "--code-share 1.5: use a share in [0, 1]"),
        (["--heldout", str(tmp_path / "none.jsonl")], f"--heldout {tmp_path / 'none.jsonl'}: no such file"),
        (["--min-chars", "50", "--max-chars", "10"], "use 1 <= --min-chars <= --max-chars"),
        (["--out", str(tmp_path)], f"--out {tmp_path} is a folder"),
    ]:
        assert magpie_main([*base, *extra]) == 2
        assert message in capsys.readouterr().err
    assert magpie_main(["--target", str(tmp_path / "none"), *base[2:]]) == 2
    assert "no such folder or .gguf file" in capsys.readouterr().err


def registry_sources(folder: Path) -> list[str]:
    """A ShareGPT file of 8 one-turn conversations (3 ask for code), a LeetCode folder of 2 problems
    and a ChatterBot corpus of 1 coding request: the flags that point dflash.data.prompts at them."""
    asks = ["Write a python function that reverses a linked list", "Explain the SQL query SELECT name FROM users",
            "Fix the bug in my javascript code: let x = 1;", "Tell me about the history of the Roman empire",
            "What should I cook tonight with rice and beans?", "Describe the water cycle for a child in school",
            "Plan a weekend trip to the mountains in spring", "Summarise the plot of a famous old novel for me"]
    folder.mkdir()
    (folder / "sharegpt.json").write_text(json.dumps([
        {"id": f"c{i}", "conversations": [{"from": "human", "value": ask}, {"from": "gpt", "value": "Sure."}]}
        for i, ask in enumerate(asks)]))
    problems = folder / "problems"
    problems.mkdir()
    for name in ("two_sum", "add_binary"):
        (problems / f"{name}.json").write_text(json.dumps({
            "problem_title": name.replace("_", " ").title(), "readme_description": f"Solve {name} in linear time.",
            "_solution_methods": {"list": [{"name": name, "signature": "(self, nums: list[int]) -> int"}]}}))
    (folder / "coding.yml").write_text(
        "conversations:\n- - can you write a python function to parse json?\n  - Sure.\n")
    return ["--sharegpt-source", str(folder / "sharegpt.json"), "--leetcode-source", str(problems),
            "--chatterbot-source", str(folder / "coding.yml"), "--heldout", "2"]


def test_one_command_builds_n_prompts_from_the_registry_and_the_target(writer, tmp_path, capfd):
    from dflash.data.prompts import main as prompts_main
    out = tmp_path / "data"
    argv = ["--out-dir", str(out), "--n", "13", *registry_sources(tmp_path / "src"), "--target", str(writer),
            "--max-new-tokens", "64", "--batch-tokens", "4096", "--device", "cpu", "--dtype", "float32"]
    assert prompts_main(argv) == 0
    records = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    summary = json.loads((out / "prompts.json").read_text())
    sharegpt_code = summary["taken"]["sharegpt"]["code_requests"]
    assert summary["taken"] == {"sharegpt": {"prompts": 6, "code_requests": sharegpt_code},
                                "sharegpt-later": {"prompts": 0, "code_requests": 0},  # one-turn conversations
                                "leetcode": {"prompts": 2, "code_requests": 2},
                                "chatterbot": {"prompts": 1, "code_requests": 1},
                                "magpie": {"prompts": 4, "code_requests": 0}}
    assert len(records) == 13 and len({r["id"] for r in records}) == 13
    assert sorted(r["source"] for r in records) == ["chatterbot"] + ["leetcode"] * 2 + ["magpie"] * 4 + ["sharegpt"] * 6
    heldout = {json.loads(line)["messages"][-1]["content"] for line in (out / "heldout.jsonl").read_text().splitlines()}
    assert len(heldout) == 2 and not heldout & {r["messages"][-1]["content"] for r in records}
    assert f"{out / 'prompts.jsonl'}: 13 prompts: 6 sharegpt" in capfd.readouterr().err
    answered = tmp_path / "regen.jsonl"  # the first K lines are what a data curve regenerates
    assert regenerate_main(["--target", str(writer), "--prompts", str(out / "prompts.jsonl"), "--output",
                            str(answered), "--limit", "5", "--max-new-tokens", "4", "--engine", "fast",
                            "--device", "cpu", "--dtype", "float32"]) == 0
    assert len(answered.read_text().splitlines()) == 5


def test_a_code_share_is_met_from_the_registry_and_a_shortfall_without_a_target_is_one_line(tmp_path, capfd):
    from dflash.data.prompts import is_code_request, main as prompts_main
    out = tmp_path / "data"
    sources = registry_sources(tmp_path / "src")
    assert prompts_main(["--out-dir", str(out), "--n", "6", "--code-share", "0.5", *sources]) == 0
    records = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert len(records) == 6 and sum(map(is_code_request, records)) == 3
    capfd.readouterr()
    assert prompts_main(["--out-dir", str(out), "--n", "12", "--code-share", "0.5", *sources]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "leave 1 code request and 2 other prompts missing; pass --target" in err
