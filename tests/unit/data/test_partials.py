"""dflash.data.partials and the share-out of regeneration: the partial files of any number of
ranks are all read, a torn or old-format line is dropped and never glued to the next one, the
output comes in input order only when every reply is there, and the shares are balanced."""

from __future__ import annotations

import json

import pytest

from dflash.data.chat_formats import DataError
from dflash.data.partials import PartialSink, _cut_torn_line, partial_files, partial_path, read_partials, write_output
from dflash.data.regenerate import split_by_length

CONVERSATIONS = [[{"role": "user", "content": f"question {i}"}] for i in range(4)]


def line(index: int) -> str:
    reply = {"token_ids": [index, 2], "finish_reason": "stop", "thinking": "off"}
    return json.dumps({"index": index, "reply": f"answer {index}", "target_reply": reply}) + "\n"


def test_every_ranks_partial_file_is_read_whatever_the_world_size(tmp_path):
    output = tmp_path / "regen.jsonl"
    assert partial_path(output, 0).name == "regen.jsonl.partial"
    assert partial_path(output, 3).name == "regen.jsonl.rank3.partial"
    partial_path(output, 0).write_text(line(0) + json.dumps({"index": 1, "reply": "an older format"}) + "\n")
    partial_path(output, 3).write_text(line(3) + line(0).replace("answer", "again") + '{"index": 2, "re')
    partial_path(output, 1).write_text(line(1))
    for stranger in ("regen.jsonl.rankX.partial", "other.jsonl.rank2.partial", "regen.jsonl.rank2.partial.bak"):
        (tmp_path / stranger).write_text(line(2))
    assert [p.name for p in partial_files(output)] == [
        "regen.jsonl.partial", "regen.jsonl.rank1.partial", "regen.jsonl.rank3.partial"]
    lines, dropped = read_partials(output)
    assert sorted(lines) == [0, 1, 3] and dropped == 2  # the older format and the torn line
    assert lines[0] == line(0).strip()  # a reply written twice: the first file's


def test_a_torn_last_line_is_cut_before_appending(tmp_path):
    path = tmp_path / "regen.jsonl.partial"
    path.write_text(line(0) + '{"index": 1, "reply": "half a li')
    with PartialSink(path) as sink:
        sink.write(1, "answer 1", json.loads(line(1))["target_reply"])
        sink.flush()
    assert path.read_text() == line(0) + line(1)
    path.write_text("x" * 10 + "\n" + "y" * 10)  # the cut found further back than one read
    _cut_torn_line(path, chunk=4)
    assert path.read_text() == "x" * 10 + "\n"
    path.write_text("no newline at all")
    _cut_torn_line(path, chunk=4)
    assert path.read_text() == ""


def test_the_output_is_in_input_order_once_every_reply_is_there(tmp_path):
    output = tmp_path / "regen.jsonl"
    partial_path(output, 0).write_text(line(3) + line(1))
    partial_path(output, 1).write_text(line(0))
    with pytest.raises(DataError, match="1 of 4 replies are in no partial file .*the first: conversation 3"):
        write_output(output, CONVERSATIONS, read_partials(output)[0])
    assert not output.exists() and len(partial_files(output)) == 2  # nothing lost
    partial_path(output, 2).write_text(line(2))
    write_output(output, CONVERSATIONS, read_partials(output)[0])
    records = [json.loads(text) for text in output.read_text().splitlines()]
    assert [r["messages"] for r in records] == [
        [*CONVERSATIONS[i], {"role": "assistant", "content": f"answer {i}"}] for i in range(4)]
    assert [r["target_reply"]["token_ids"] for r in records] == [[i, 2] for i in range(4)]
    assert partial_files(output) == []


def test_the_shares_match_in_count_and_length():
    sizes = {i: (i * 37) % 101 for i in range(103)}
    shares = split_by_length(sizes, 4)
    assert sorted(i for share in shares for i in share) == list(range(103))
    assert {len(share) for share in shares} == {25, 26}
    totals = [sum(sizes[i] for i in share) for share in shares]
    assert max(totals) - min(totals) <= max(sizes.values())
    assert split_by_length(sizes, 1) == [sorted(sizes, key=lambda i: (-sizes[i], i))]
