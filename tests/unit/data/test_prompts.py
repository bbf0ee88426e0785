"""Tests for dflash.data.prompts' policy: which registry prompts are taken for N, by class."""

from __future__ import annotations

from dflash.data.prompts import is_code_request, pick_registry_prompts


def prompt(i: int, code: bool) -> dict:
    text = f"Write a python function that sorts list {i}" if code else f"Tell me a story about a cat named {i}"
    return {"id": f"p:{i}", "messages": [{"role": "user", "content": text}]}


RECORDS = [prompt(i, code=i % 4 == 0) for i in range(40)]  # 10 code requests, 30 others


def test_the_fixture_holds_ten_code_requests():
    assert sum(map(is_code_request, RECORDS)) == 10


def test_without_a_code_share_n_prompts_are_taken_and_none_is_missing():
    pick = pick_registry_prompts(RECORDS, 25, None, seed=0)
    assert len(pick.records) == 25 and len({r["id"] for r in pick.records}) == 25
    assert pick.missing == {None: 0}
    assert pick_registry_prompts(RECORDS, 50, None, seed=0).missing == {None: 10}


def test_a_code_share_fills_each_class_and_counts_what_it_misses():
    pick = pick_registry_prompts(RECORDS, 24, 0.25, seed=0)
    assert sum(map(is_code_request, pick.records)) == 6 and len(pick.records) == 24
    assert pick.missing == {True: 0, False: 0}
    short = pick_registry_prompts(RECORDS, 20, 0.75, seed=0)  # 15 code requests asked, 10 there
    assert sum(map(is_code_request, short.records)) == 10 and len(short.records) == 15
    assert short.missing == {True: 5, False: 0}


def test_the_seed_fixes_the_sample_and_another_seed_changes_it():
    ids = [r["id"] for r in pick_registry_prompts(RECORDS, 12, 0.5, seed=3).records]
    assert ids == [r["id"] for r in pick_registry_prompts(RECORDS, 12, 0.5, seed=3).records]
    assert ids != [r["id"] for r in pick_registry_prompts(RECORDS, 12, 0.5, seed=4).records]
