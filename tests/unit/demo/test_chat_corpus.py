"""The chat demo target's corpus selection: held-out prompts, long prompts and a count cap."""

from __future__ import annotations

import json

from dflash.demo.chat_corpus import first_turns, load_conversations


def chat(prompt: str, reply: str = "ok") -> dict:
    return {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt},
                         {"role": "assistant", "content": reply}]}


def write(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_selection_drops_held_out_and_long_prompts_then_caps_the_count(tmp_path):
    chats, prompts = tmp_path / "chats.jsonl", tmp_path / "heldout.jsonl"
    write(chats, [chat("what is tcp"), chat("x" * 50), chat("  name a colour "), chat("why is the sky blue"),
                  chat("how do tides work"), chat("what is udp")])
    write(prompts, [{"messages": [{"role": "user", "content": "name a colour"}]}, {"prompt": "what is udp"}])
    assert first_turns(prompts) == {"name a colour", "what is udp"}

    def opening_prompts(**filters) -> list[str]:
        train, heldout = load_conversations([chats], **filters)
        return [m[1]["content"] for m in train + heldout]

    assert len(opening_prompts()) == 6
    kept = opening_prompts(exclude_prompts=first_turns(prompts), max_prompt_chars=20)
    assert sorted(kept) == ["how do tides work", "what is tcp", "why is the sky blue"]
    # the cap counts conversations that passed the filters, in file order
    assert sorted(opening_prompts(exclude_prompts=first_turns(prompts), max_prompt_chars=20, limit=2)) == [
        "what is tcp", "why is the sky blue"]
