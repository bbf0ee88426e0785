"""Tests for dflash.data.magpie's parts: the user header cut from the chat template, the engine's
replies read as turns, the filters of the pool and the round plan."""

from __future__ import annotations

from collections import Counter

import pytest
from tiny_tokenizer import make_tiny_tokenizer

from dflash.data.chat_formats import DataError
from dflash.data.magpie import (
    CUT, EXACT, HELDOUT, LONG, NEAR, NOT_ASCII, OVER_QUOTA, SHORT, PromptPool, plan_round, turn_of, user_header)

# Qwen2.5's template, without its tool branch: a default system prompt unless the first message is one.
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
NO_SYSTEM_TEMPLATE = (  # Gemma's way: a system message is refused
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}{{ raise_exception('System role not supported') }}{%- endif %}"
    "{{- '<start_of_turn>' + message.role + '\\n' + message.content | trim + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
)


def tokenizer_with(template: str):
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


def test_the_header_is_the_templates_user_header():
    assert user_header(make_tiny_tokenizer()) == "<|im_start|>user\n"
    qwen = tokenizer_with(QWEN_TEMPLATE)
    assert user_header(qwen) == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                                 "assistant.<|im_end|>\n<|im_start|>user\n")
    assert user_header(qwen, "You write code.") == "<|im_start|>system\nYou write code.<|im_end|>\n<|im_start|>user\n"
    assert user_header(tokenizer_with(NO_SYSTEM_TEMPLATE)) == "<start_of_turn>user\n"


def test_a_template_that_cannot_give_the_header_is_named():
    with pytest.raises(DataError, match="cannot render with --code-system-prompt .*--code-system-prompt ''"):
        user_header(tokenizer_with(NO_SYSTEM_TEMPLATE), "You write code.")
    shouting = tokenizer_with("{%- for m in messages %}{{ m.role + ': ' + m.content | lower }}{%- endfor %}")
    with pytest.raises(DataError, match="does not render a user message's text as given"):
        user_header(shouting)


def test_engine_replies_become_turns_without_the_stop_token():
    stops = {2, 3}
    assert turn_of(([5, 6, 2], "stop"), 8, stops) == ([5, 6], True)
    assert turn_of(([5, 6, 7, 8], "length"), 4, stops) == ([5, 6, 7, 8], False)
    assert turn_of([5, 6], 8, stops) == ([5, 6], True)  # bare ids, the stop token left out
    assert turn_of([5, 6, 7, 8], 4, stops) == ([5, 6, 7, 8], False)


def pool(**overrides) -> PromptPool:
    settings = dict(n=100, min_chars=20, max_chars=120, near_dup=0.6, code_share=None, heldout=[])
    return PromptPool(**{**settings, **overrides})


def test_each_filter_drops_what_it_should_and_is_counted():
    held = "Tell me the story of the three little pigs, but set it on Mars and make it funny."
    near_held = held.replace("it funny", "it very funny")
    prompts = pool(heldout=[held])
    offers = [
        ("Give me three ideas for a birthday party for a seven year old.", True, None),
        ("Give me three ideas for a birthday party for a seven year old", False, CUT),
        ("Hi there!", True, SHORT),
        ("Explain photosynthesis. " * 10, True, LONG),
        ("Объясни, пожалуйста, как работает фотосинтез у растений.", True, NOT_ASCII),
        (near_held, True, HELDOUT),
        ("  give me THREE ideas for a birthday party, for a seven-year-old!  ", True, EXACT),
        ("Give me three ideas for a birthday party for an eight year old.", True, NEAR),
        ("What are the main causes of the French Revolution?", True, None),
    ]
    for text, ended, dropped in offers:
        assert prompts.offer(text, ended) == dropped, text
    assert prompts.kept == [offers[0][0], offers[-1][0]]
    assert prompts.dropped == Counter({f: 1 for f in (CUT, SHORT, LONG, NOT_ASCII, HELDOUT, EXACT, NEAR)})
    assert prompts.missing() == {None: 98} and not prompts.full()


def test_the_code_share_keeps_its_quota_of_each_class():
    code = ["Write a Python function that merges two sorted lists.", "How do I read a JSON file in Java?",
            "Why does my SQL query return duplicate rows?"]
    prose = ["What should I pack for a week in Iceland?", "Suggest a name for my new bakery downtown.",
             "How can I sleep better when I travel a lot?"]
    prompts = pool(n=4, code_share=0.5)
    verdicts = [prompts.offer(text, True) for pair in zip(code, prose) for text in pair]
    assert verdicts == [None, None, None, None, OVER_QUOTA, OVER_QUOTA]
    assert prompts.kept == [code[0], prose[0], code[1], prose[1]] and prompts.full()
    assert prompts.passed == Counter({True: 3, False: 3})
    none = pool(n=2, code_share=0.0)
    assert [none.offer(t, True) for t in (code[0], prose[0], prose[1])] == [OVER_QUOTA, None, None]
    assert none.full()


def test_a_round_samples_what_is_missing_at_the_yield_so_far():
    assert plan_round({None: 100}, Counter(), 0, steer=False) == (125, 0)
    # 40 of 200 rows passed: 60 more need 60 / 0.2 x 1.1 rows
    assert plan_round({None: 60}, Counter({None: 40}), 200, steer=False) == (330, 0)
    # code: 30 passed of 100 rows, 20 missing -> 74 rows; others: 10 missing, 50 of 100 -> 22; steered 2/3
    assert plan_round({True: 20, False: 10}, Counter({True: 30, False: 50}), 100, steer=True) == (25, 49)
    assert plan_round({True: 0, False: 10}, Counter({True: 30, False: 50}), 100, steer=True) == (22, 0)
    assert plan_round({None: 10}, Counter(), 1000, steer=False) == (100, 0)  # nothing passed yet: at most 10 x
